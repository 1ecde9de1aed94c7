"""SGLang 0.5.23's own ReplaySSM kernels in their flow (``--flow sglang-replayssm``),
from an installed ``sglang`` with ``triton`` (docs/semantics.md §6):

* ``--kernel sglang-replayssm-triton``: :class:`ReplayVerifyAdapter` calls
  ``gdn_replayssm_spec_decode(..., launch_mode="verify", null_block_id=-1)`` per layer, as
  ``srt/layers/attention/linear/gdn_backend.py: _replayssm_target_verify`` does: q, k, v split from
  the post-conv ``mix_qkv`` (the kernel L2-normalises them), the raw gate input ``a`` with
  ``A_log`` / ``dt_bias`` (the kernel computes g) and the beta logits, the checkpoint, the ring
  (``beta_cache=None``: compact records with low parts), the packed ``query_start_loc``, the
  checkpoint and ring slots and the cursors of :class:`drift.flows.kernel_commit.flow.ReplayPool`;
* ``--update drift.plug.replayssm_engine:sglang_commit``: SGLang's ``commit_gdn_replayssm_spec``
  and ``commit_gdn_replayssm_circular`` on the harness, as ``srt/speculative/spec_utils.py:
  commit_mamba_states_after_verify`` calls them, then drift's conv rollback (SGLang's conv
  scatter, ``fused_conv_window_scatter_with_mask``, works on the CUDA window layout drift does
  not keep: docs/semantics.md §10).

A GPU runs them; a CPU only under ``TRITON_INTERPRET=1`` (slow: tests run a few steps, and stub
SGLang's parent packages themselves -- drift does not).
"""

from __future__ import annotations

import torch

from ..errors import LoadError
from ..sim.kernels import VerifyArgs
from ..sim.pool import raw_state
from .adapter import engine_function
from ..flows.kernel_commit.updates import Commit, conv_rollback

MODULE = "sglang.kernels.ops.attention.linear.gdn_replayssm_spec_decode"
ENGINE = "sglang (0.5.23 was modelled)"
KERNEL = "sglang-replayssm-triton"
BF16, F32, I32 = torch.bfloat16, torch.float32, torch.int32


class ReplayVerifyAdapter:
    """SGLang's ReplaySSM verify kernel as a drift verify kernel of the ``ring`` rule (the mapping above)."""

    TRITON = True  # a Triton kernel (drift.plug.triton_interpreter.how_it_ran)

    def __init__(self, op):
        self.op = op
        self.__qualname__ = KERNEL

    @classmethod
    def load(cls) -> "ReplayVerifyAdapter":
        return cls(engine_function(MODULE, "gdn_replayssm_spec_decode", KERNEL, ENGINE))

    def __call__(self, args: VerifyArgs) -> torch.Tensor:
        pool = getattr(args.rule, "pool", None)  # the ring rule's ReplayPool (drift/flows/kernel_commit/rule.py)
        if pool is None:
            raise LoadError(f"--kernel {KERNEL} verifies by the ring rule: run it under --flow sglang-replayssm")
        if args.gate_inputs is None:
            raise ValueError(f"{KERNEL} computes the gating itself and needs VerifyArgs.gate_inputs (a, A_log, dt_bias)")
        L, B, S, HV, V, K = args.dims
        H, T, dev = args.nk, B * S, args.mix_qkv.device
        mix = args.mix_qkv.reshape(L, T, -1)
        q, k = mix[..., : H * K].reshape(L, T, H, K), mix[..., H * K: 2 * H * K].reshape(L, T, H, K)
        v = mix[..., 2 * H * K:].reshape(L, T, HV, V)
        a, A_log, dt_bias = args.gate_inputs
        a = a.reshape(L, T, HV)
        b = args.beta.reshape(L, T, HV)
        qsl = torch.arange(0, T + 1, S, dtype=I32, device=dev)
        state = raw_state(args.recurrent_state)
        out = torch.empty(L, T, HV, V, dtype=mix.dtype, device=dev)
        idx = pool.state_indices.to(I32)
        replay = pool.replay_indices.to(I32)
        for l in range(L):
            self.op(q=q[l].contiguous(), k=k[l].contiguous(), v=v[l].contiguous(), a=a[l].contiguous(),
                    b=b[l].contiguous(), A_log=A_log[l].to(F32).contiguous(), dt_bias=dt_bias[l].to(F32).contiguous(),
                    checkpoint_state=state[l], d_cache=pool.ring_d[l], k_cache=pool.ring_k[l], g_cache=pool.ring_g[l],
                    rawv_cache=pool.ring_d_lo[l], rawk_cache=pool.ring_k_lo[l], beta_cache=None, out=out[l],
                    query_start_loc=qsl, ssm_state_indices=idx, replay_indices=replay, write_pos=pool.write_pos,
                    cache_base=pool.cache_base, is_flush=pool.is_flush, max_cache_len=pool.ring_len, max_spec_len=S,
                    scale=K ** -0.5, use_qk_l2norm_in_kernel=True, null_block_id=-1, launch_mode="verify")
        return out.view(L, B, S, HV, V).to(BF16)


COMMIT = "the update drift.plug.replayssm_engine:sglang_commit (SGLang's ReplaySSM commit kernels)"


def _commit_kernels():
    spec = engine_function(MODULE, "commit_gdn_replayssm_spec", "sglang-replayssm-triton", ENGINE, COMMIT)
    circular = engine_function(MODULE, "commit_gdn_replayssm_circular", "sglang-replayssm-triton", ENGINE, COMMIT)
    return spec, circular


def sglang_commit(self, last_correct_step_indices, mamba_track_indices=None, mamba_steps_to_track=None):
    """SGLang 0.5.23's ReplaySSM commit kernels on a :class:`drift.flows.kernel_commit.flow.ReplayHarness`, then
    drift's conv rollback (the engine's own code under test of the sglang-replayssm flow)."""
    ss, mp = self.spec_state, self.mamba_pool  # first: under another flow the harness names what it lacks
    spec, circular = _commit_kernels()
    last = last_correct_step_indices.to(torch.int64)
    accept = torch.clamp(last + 1, min=0)  # accept_lens: the accepted drafts and the bonus token
    spec(write_pos=mp.replayssm_spec_write_pos, cache_base=mp.replayssm_cache_base, is_flush=mp.replayssm_is_flush,
         num_accepted=accept, replay_indices=self.req_pool_indices, max_cache_len=ss.replayssm_d.shape[-2],
         max_spec_len=self.draft_token_num, fold_every_commit=self.fold_every_commit, null_block_id=-1)
    track = steps = None
    if mamba_track_indices is not None:
        track, steps = mamba_track_indices.to(torch.int64), mamba_steps_to_track.to(torch.int64)
    circular(checkpoint_state=raw_state(ss.temporal), d_cache=ss.replayssm_d, k_cache=ss.replayssm_k,
             g_cache=ss.replayssm_g, d_residual_cache=ss.replayssm_rawv, k_residual_cache=ss.replayssm_rawk,
             state_batch_indices=self.state_batch_indices, replay_indices=self.req_pool_indices,
             write_pos=mp.replayssm_spec_write_pos, cache_base=mp.replayssm_cache_base, is_flush=mp.replayssm_is_flush,
             accept_lens=accept, mamba_track_indices=track, mamba_steps_to_track=steps, null_block_id=-1)
    conv_rollback(Commit(self, accept, last, track, steps))


sglang_commit.TRITON = True  # SGLang's Triton commit kernels (drift.plug.triton_interpreter.how_it_ran)
