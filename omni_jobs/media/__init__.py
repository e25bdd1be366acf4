"""What stages pass and take in memory: payloads (clips, tensors), latent previews, audio formats, decoded
audio and video files, and a job's input files."""
