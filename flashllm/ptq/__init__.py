"""Post-training quantization over a loaded model: calibration, AWQ / SmoothQuant search, the checkpoint writer."""
