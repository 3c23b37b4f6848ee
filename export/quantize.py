"""Static int8 quantization (QDQ) of an exported fp32 file, calibrated on real images.

Static rather than dynamic: onnxruntime's dynamic quantization only covers MatMul/Gemm-style ops,
so it would leave the convolutions, i.e. almost all the compute of a ResNet, in fp32. Per-channel
weight scales keep the small (narrow) submodels accurate.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static
from onnxruntime.quantization.shape_inference import quant_pre_process


class _Reader(CalibrationDataReader):
    def __init__(self, input_name: str, inputs: np.ndarray, batch_size: int) -> None:
        self._batches = iter([{input_name: inputs[i:i + batch_size]} for i in range(0, len(inputs), batch_size)])

    def get_next(self) -> dict[str, np.ndarray] | None:
        return next(self._batches, None)


def quantize_int8(fp32_path: str | Path, out_path: str | Path, calibration: np.ndarray,
                  input_name: str = "input", batch_size: int = 32) -> Path:
    """Write the int8 QDQ model beside the fp32 one; `calibration` are normalised real inputs."""
    out = Path(out_path)
    prepped = out.with_suffix(".prep.onnx")
    try:
        quant_pre_process(str(fp32_path), str(prepped), skip_symbolic_shape=True)
        quantize_static(
            str(prepped), str(out), _Reader(input_name, calibration, batch_size),
            quant_format=QuantFormat.QDQ, activation_type=QuantType.QInt8, weight_type=QuantType.QInt8,
            per_channel=True,
        )
    finally:
        prepped.unlink(missing_ok=True)
    return out
