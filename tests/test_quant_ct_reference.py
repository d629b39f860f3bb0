"""compressed-tensors as the oracle: scales and bytes computed by CT's own functions (no tests here).

The chain is the one llm-compressor runs for NVFP4A16 / MXFP4A16 with its min-max observer:
``generate_gparam`` (global scale) -> ``calculate_qparams`` (block scales, per-group min/max in the
weight dtype) -> the scale stored in a parameter of the weight dtype -> the compressor's ``compress``
(element quantization and packing) / ``decompress``.
"""

import ml_dtypes
import numpy as np
import torch
from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor
from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
from compressed_tensors.quantization import QuantizationScheme
from compressed_tensors.quantization.quant_scheme import MXFP4A16, NVFP4A16
from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam

NVFP4_SCHEME = QuantizationScheme(targets=["Linear"], **NVFP4A16)
MXFP4_SCHEME = QuantizationScheme(targets=["Linear"], **MXFP4A16)


def ct_global_scale(w_NxK: torch.Tensor) -> torch.Tensor:
  return generate_gparam(w_NxK.min(), w_NxK.max())


def _block_scale(w_NxK, scheme, gs):
  args = scheme.weights
  g = w_NxK.unflatten(-1, (w_NxK.shape[-1] // args.group_size, args.group_size))
  scale, _ = calculate_qparams(g.amin(-1), g.amax(-1), args, global_scale=gs)
  # llm-compressor keeps weight_scale in a parameter of the weight's dtype.
  return scale.to(w_NxK.dtype)


def ct_nvfp4(w_NxK: torch.Tensor, gs: torch.Tensor | None = None) -> dict[str, np.ndarray]:
  """{weight_packed, weight_scale, weight_global_scale} exactly as compressed-tensors writes them."""
  gs = ct_global_scale(w_NxK) if gs is None else gs
  sd = {"weight": w_NxK, "weight_scale": _block_scale(w_NxK, NVFP4_SCHEME, gs),
        "weight_global_scale": gs}
  out = NVFP4PackedCompressor.compress(sd, NVFP4_SCHEME)
  return {
    "weight_packed": out["weight_packed"].numpy(),
    "weight_scale": out["weight_scale"].view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn),
    "weight_global_scale": out["weight_global_scale"].numpy(),
  }


def ct_mxfp4(w_NxK: torch.Tensor) -> dict[str, np.ndarray]:
  sd = {"weight": w_NxK, "weight_scale": _block_scale(w_NxK, MXFP4_SCHEME, None)}
  out = MXFP4PackedCompressor.compress(sd, MXFP4_SCHEME)
  return {"weight_packed": out["weight_packed"].numpy(), "weight_scale": out["weight_scale"].numpy()}


def ct_decompress(tensors: dict[str, np.ndarray], scheme: str) -> np.ndarray:
  """compressed-tensors' decompression (always bf16) of stored tensors, as float32 NumPy."""
  sd = {"weight_packed": torch.from_numpy(np.ascontiguousarray(tensors["weight_packed"]))}
  if scheme == "nvfp4":
    scale = np.ascontiguousarray(tensors["weight_scale"]).view(np.uint8)
    sd["weight_scale"] = torch.from_numpy(scale).view(torch.float8_e4m3fn)
    sd["weight_global_scale"] = torch.from_numpy(np.asarray(tensors["weight_global_scale"]))
    out = NVFP4PackedCompressor.decompress(sd, NVFP4_SCHEME)
  else:
    sd["weight_scale"] = torch.from_numpy(np.ascontiguousarray(tensors["weight_scale"]))
    out = MXFP4PackedCompressor.decompress(sd, MXFP4_SCHEME)
  return out["weight"].float().numpy()


def to_torch(w: np.ndarray) -> torch.Tensor:
  """NumPy float32 / ml_dtypes bfloat16 -> torch tensor of the same dtype and bits."""
  if w.dtype == ml_dtypes.bfloat16:
    return torch.from_numpy(np.ascontiguousarray(w).view(np.uint16)).view(torch.bfloat16)
  return torch.from_numpy(np.ascontiguousarray(w))
