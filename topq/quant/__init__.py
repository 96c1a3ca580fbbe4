"""Quantization machinery shared by the scheme plugins: grids and rounding, observers, calibration data, the
layer loop."""
