"""What every tiny model build shares: the corpus its tokenizers are trained on, and a seeded build.

Kept apart so that the tiny text models (omni_jobs.local.tiny) and the multimodal ones
(omni_jobs.local.tiny_multimodal) each import it and not each other.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

CORPUS: tuple[str, ...] = (
    "The quick brown fox jumps over the lazy dog.",
    "A watercolor painting of a lighthouse on a rocky coast at sunset.",
    "A photo of a red cat sleeping on a blue sofa next to a window.",
    "Once upon a time there was a small robot who wanted to learn how to paint.",
    "The city was quiet in the early morning, and the streets were wet with rain.",
    "She opened the old book and found a map drawn in faded green ink.",
    "An astronaut riding a horse on the moon, digital art, high detail.",
    "A bowl of fresh fruit with apples, oranges and grapes on a wooden table.",
    "The mountains were covered with snow and the sky was clear and bright.",
    "He wrote a short poem about the sea, the wind and the stars at night.",
    "Generate an image of a futuristic city with flying cars and tall glass towers.",
    "Describe the picture in one sentence, then write a caption for it.",
    "What is the capital of France? The capital of France is Paris.",
    "Please summarize the following text in three short sentences.",
    "A cozy cabin in the forest with smoke rising from the chimney in winter.",
    "Two children playing with a yellow kite on a green hill in the summer.",
    "A close-up portrait of an old man with a white beard and kind eyes.",
    "The train left the station at nine o'clock and arrived before noon.",
    "A plate of pasta with tomato sauce, basil and parmesan cheese.",
    "An abstract pattern of circles, squares and triangles in bright colors.",
    "The music was soft and slow, and everyone in the room stopped to listen.",
    "A small boat sailing across a calm lake under a purple evening sky.",
    "Write a story about a dragon who is afraid of the dark.",
    "The garden was full of roses, tulips and sunflowers after the spring rain.",
    "A black and white photograph of a busy market street in the morning.",
    "The scientist looked through the microscope and saw something new.",
    "A friendly dog with a red collar running on the beach near the waves.",
    "Numbers like 1, 2, 3, 10, 42, 100 and 2024 appear in many texts.",
    "Questions, answers, lists: first, second, third; and so on!",
    "Hello, world! How are you today? I am fine, thank you.",
)


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Seed torch for a build without disturbing the caller's RNG state."""
    import torch

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield
