"""Fused NVFP4 weight-only matmul kernels (Pallas, Triton backend) with an XLA fallback."""

from qerl_kernels.config import Nvfp4MatmulConfig, get_config, heuristic_config  # noqa: F401
from qerl_kernels.nvfp4_matmul import (  # noqa: F401
  IMPLEMENTATIONS, Nvfp4Group, default_implementation, nvfp4_matmul, nvfp4_matmul_reference, xla_backward_layout,
  xla_dequant, xla_min_rows,
)
from qerl_kernels.nvfp4_matmul_bwd import nvfp4_matmul_bwd_pallas  # noqa: F401
from qerl_kernels.nvfp4_matmul_fwd import nvfp4_matmul_fwd_pallas  # noqa: F401
from qerl_kernels.nvfp4_matmul_xa import (  # noqa: F401
  nvfp4_matmul_xa, nvfp4_matmul_xa_partials, partials_launch_applies, xa_shares_launch,
)
