"""Pool layouts: how the committed states, the verify scratch and the conv windows lie in memory.

A state's meaning is always its raw memory read as ``[HV, V, K]`` blocks (the verify op's ABI,
docs/semantics.md §3-§4); a layout decides which *view* of that memory the update under test is
handed. A transposed view of ``[.., K, V]`` storage makes code that silently works on a
``.contiguous()`` copy or a ``reshape`` lose its writes (sgl-kernel-npu #748); a channel-major conv
window does the same for the conv rollback. Each entry allocates its three tensors; the pool
(drift/sim/pool.py) asks the entry, never the layout's name.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .registry import Registry


def _state_view(lead: tuple, V: int, K: int, dtype: torch.dtype, device, kv_storage: bool) -> torch.Tensor:
    """Zeros seen as ``[*lead, V, K]``: dense, or a transposed view of ``[*lead, K, V]`` storage."""
    if kv_storage:
        return torch.zeros(*lead, K, V, dtype=dtype, device=device).transpose(-1, -2)
    return torch.zeros(*lead, V, K, dtype=dtype, device=device)


@dataclass(frozen=True)
class Layout:
    """Which of the pool's tensors are transposed views, and what that models."""

    name: str
    state_kv_storage: bool  # temporal [L, S, HV, V, K] a transposed view of [.., K, V] storage
    scratch_kv_storage: bool  # intermediate_ssm likewise
    conv_channel_major: bool  # conv [L, S, W, C] a transposed view of [L, S, C, W] storage
    description: str

    @property
    def dense(self) -> bool:
        """Whether every tensor is dense (none a transposed view)."""
        return not (self.state_kv_storage or self.scratch_kv_storage or self.conv_channel_major)

    def state(self, lead: tuple, V: int, K: int, dtype: torch.dtype, device) -> torch.Tensor:
        """Committed states ``[*lead, V, K]`` (zeros)."""
        return _state_view(lead, V, K, dtype, device, self.state_kv_storage)

    def scratch(self, lead: tuple, V: int, K: int, dtype: torch.dtype, device) -> torch.Tensor:
        """Verify scratch ``[*lead, V, K]`` (zeros)."""
        return _state_view(lead, V, K, dtype, device, self.scratch_kv_storage)

    def conv(self, lead: tuple, W: int, C: int, dtype: torch.dtype, device) -> torch.Tensor:
        """Conv windows ``[*lead, W, C]`` (zeros)."""
        if self.conv_channel_major:
            return torch.zeros(*lead, C, W, dtype=dtype, device=device).transpose(-1, -2)
        return torch.zeros(*lead, W, C, dtype=dtype, device=device)


LAYOUTS: Registry[Layout] = Registry("layout")
LAYOUTS.register("contiguous", Layout(
    "contiguous", False, False, False,
    "every tensor dense: SGLang 0.5.23's MambaPool (srt/mem_cache/memory_pool.py) and "
    "_init_npu_conv_state (srt/hardware_backend/npu/memory_pool_npu.py)"))
LAYOUTS.register("transposed", Layout(
    "transposed", True, True, True,
    "state and scratch transposed views of [K, V] storage, conv a view of channel-major storage "
    "(the layout sgl-kernel-npu #748 describes)"))
LAYOUTS.register("state-transposed", Layout(
    "state-transposed", True, False, False,
    "committed state a transposed view, scratch and conv dense: a logical copy and a raw copy differ"))
LAYOUTS.register("scratch-transposed", Layout(
    "scratch-transposed", False, True, False,
    "committed state dense, scratch a transposed view: the fourth pairing of the two block layouts "
    "(no profile uses it; the raw-copy kernels must handle it)"))
