"""vLLM 0.33.0's own per-step MTP bookkeeping as the code under test of the ``vllm`` flow, from an
installed ``vllm`` with its CPU-side dependencies (docs/semantics.md §6; issue 32 item 5):

* ``vllm/v1/worker/gpu_model_runner.py: GPUModelRunner._update_states_after_model_execute``
  (``num_accepted_tokens.gpu[:num_reqs] = (output_token_ids != -1).sum(dim=1)``), on the runner
  vLLM builds for the device (``CPUModelRunner``, its subclass, on a CPU), through its own ``__init__``;
* ``vllm/v1/attention/backends/gdn_attn.py: GDNAttentionMetadataBuilder.build`` (the spec-decode
  path with FULL CUDA graphs: the persistent ``spec_state_indices_tensor`` and ``num_accepted_tokens``,
  padded rows ``NULL_BLOCK_ID`` and 1), through its own ``__init__``.

``--update drift.plug.vllm_engine:bookkeeping`` calls them once per step in that order, as vLLM's
step does (the runner after the forward, the builder before the next): the sampler's
``output_token_ids [R, D]`` (each row's accepted tokens, then -1) made from drift's accepted steps,
the runner's ``num_decode_draft_tokens`` (D - 1 per request, -1 for padded rows, as ``_prepare_inputs``
stages it) and a decode batch's ``CommonAttentionMetadata`` (``query_start_loc`` of D tokens per
request, 0 per padded row; the block table). What ``build`` returns is copied into the harness's
``num_accepted_tokens`` and ``spec_state_indices_tensor`` (drift/flows/in_place/pool.py), which the
next verify reads: drift's rendering (``vllm-0.33.0``) replaced by vLLM's own code. Under a churning
lifecycle the update carries the builder as its serving part too (:func:`serving_parts`): the flow
condenses the batch and pads it to the step's graph bucket (drift/flows/in_place/flow.py: ``arrange``)
and vLLM's ``build`` forms that step's indices, the step's requests first and its padded rows after.

The configs are vLLM's, built from the preset (:func:`vllm_config`): a ``ModelConfig`` of a
Qwen3-Next ``config.json`` with the preset's per-rank GDN heads and layers (written to a temporary
directory; no weights), ``SpeculativeConfig(method="mtp", num_speculative_tokens=D - 1)``,
``CacheConfig(mamba_cache_mode="none")``, ``SchedulerConfig(max_num_seqs=N)``, and the compilation
config's ``cudagraph_mode`` FULL (vLLM's CPU platform turns graphs off; the builder's persistent
buffers are the CUDA-graph path drift models). The world is one process (gloo).

What it cannot run, each refused (exit 2) naming why:

* prefix caching (``mamba_cache_mode="align"``, drift's tracking): its state copy is
  ``mamba_utils.postprocess_mamba_fused_kernel``, a Triton kernel over raw ``data_ptr`` addresses,
  which no CPU and no interpreter runs -- run with tracking off (``track_interval = 0``);
* ragged drafts: the builder reads each row's draft count on the host, which the scheduler knows
  and drift's update call does not carry;
* the host-sync scan's virtual device: vLLM's objects hold real device buffers (the scan's virtual
  pass would see drift's copies as syncs) -- scan on a real accelerator, or run without the scan.

vLLM imports on a CPU with ``VLLM_TARGET_DEVICE=cpu`` (set here when no CUDA device is present, before
vLLM is first imported) and these of its dependencies besides torch: psutil, cbor2, pyzmq, aiohttp,
oss-harmony, openai, pybase64, cachetools, msgspec, uvloop, prometheus_client, xgrammar, fastapi,
partial-json-parser, llguidance, einops, compressed-tensors (``pip install vllm==0.33.0`` would
replace torch with 2.14.0; docs/reference.md says how drift's CI installs them).
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
from typing import Any

import torch

from ..errors import LoadError

ENGINE = "vllm (0.33.0 was modelled)"
SPEC = "drift.plug.vllm_engine:bookkeeping"
NAME = "vllm:builder"  # its built-in name (drift/flows/in_place/__init__.py)
I32 = torch.int32


def _vllm() -> dict[str, Any]:
    """The vLLM names this module drives; LoadError naming the missing piece."""
    if not torch.cuda.is_available():
        os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # vLLM's CPU platform (else it cannot infer one)
    try:
        from vllm.config import (CacheConfig, ModelConfig, SchedulerConfig, SpeculativeConfig, VllmConfig,
                                 set_current_vllm_config)
        from vllm.config.compilation import CUDAGraphMode
        from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment
        from vllm.distributed.parallel_state import model_parallel_is_initialized
        from vllm.v1.attention.backend import CommonAttentionMetadata
        from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadataBuilder
        from vllm.v1.kv_cache_interface import MambaSpec
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner
        import vllm
    except ImportError as exc:
        raise LoadError(f"the update {NAME} needs an installed {ENGINE} that imports here: importing it raised "
                        f"{exc!r}; on a CPU install vLLM --no-deps and its CPU-side dependencies "
                        "(docs/reference.md: vLLM's own bookkeeping)") from None
    runner_cls = GPUModelRunner
    if not torch.cuda.is_available():
        from vllm.v1.worker.cpu_model_runner import CPUModelRunner
        runner_cls = CPUModelRunner
    return dict(locals())


def _qwen3_next_config(cfg) -> dict:
    """A Qwen3-Next ``config.json`` with the preset's per-rank GDN shapes (TP 1: the rank is the model)."""
    from transformers import Qwen3NextConfig

    layers = max(cfg.num_layers, 2)
    return Qwen3NextConfig(
        num_hidden_layers=layers, layer_types=["linear_attention"] * (layers - 1) + ["full_attention"],
        linear_num_key_heads=cfg.num_k_heads, linear_num_value_heads=cfg.num_v_heads,
        linear_key_head_dim=cfg.head_k_dim, linear_value_head_dim=cfg.head_v_dim,
        linear_conv_kernel_dim=cfg.conv_kernel, hidden_size=256, num_attention_heads=2, num_key_value_heads=1,
        head_dim=64, intermediate_size=256, vocab_size=1024, num_experts=2, num_experts_per_tok=1,
        moe_intermediate_size=64, shared_expert_intermediate_size=64, mtp_num_hidden_layers=1,
        max_position_embeddings=4096).to_dict()


def vllm_config(v: dict, cfg, model: str):
    """vLLM's ``VllmConfig`` for a drift config (module docstring); ``model``: an empty directory the
    model's ``config.json`` is written to (vLLM reads it again for the MTP draft model)."""
    with open(os.path.join(model, "config.json"), "w") as f:
        json.dump(_qwen3_next_config(cfg), f)
    mc = v["ModelConfig"](model=model, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=4096)
    N = cfg.num_rows
    vc = v["VllmConfig"](model_config=mc, scheduler_config=v["SchedulerConfig"](
        max_num_seqs=N, max_num_batched_tokens=4096, max_model_len=4096, is_encoder_decoder=False),
        cache_config=v["CacheConfig"](mamba_cache_mode="none", enable_prefix_caching=False))
    vc.compilation_config.cudagraph_mode = v["CUDAGraphMode"].FULL  # the persistent-buffer path
    vc.speculative_config = v["SpeculativeConfig"](method="mtp", num_speculative_tokens=cfg.num_draft_tokens - 1,
                                                   target_model_config=mc, target_parallel_config=vc.parallel_config)
    return vc


def _one_process_world(v: dict) -> None:
    if v["model_parallel_is_initialized"]():
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    v["init_distributed_environment"](world_size=1, rank=0, local_rank=0,
                                      distributed_init_method=f"tcp://127.0.0.1:{port}", backend="gloo")
    v["ensure_model_parallel_initialized"](1, 1)


def check_config(cfg) -> None:
    """LoadError (exit 2) where ``cfg`` asks what vLLM's objects cannot run here (module docstring); drift's
    preflight calls it before any test or step (the update's ``preflight``)."""
    if cfg.track_interval > 0:
        raise LoadError(f"the update {NAME} runs vLLM's bookkeeping without prefix caching: its align copy "
                        "(mamba_utils.postprocess_mamba_fused_kernel) is a Triton kernel over raw data pointers, "
                        "which no CPU runs and drift's adapter does not drive on any device; run it with tracking "
                        "off: --track-interval 0 (pytest: --drift-track-interval 0)")
    if cfg.drafts != "full":
        raise LoadError(f"the update {NAME} verifies every row's D tokens: vLLM's builder reads each row's draft "
                        "count on the host, which drift's update call does not carry; drop --drafts ragged")


class VllmBookkeeping:
    """vLLM's runner and GDN metadata builder for one harness (module docstring)."""

    def __init__(self, harness, runner_cls=None, builder_cls=None):
        pool = harness._drift_pool
        cfg = self.cfg = pool.cfg
        dev = pool.device
        if dev.type == "meta":
            raise LoadError(f"the update {NAME}: vLLM's objects hold real device buffers, so the host-sync scan's "
                            "virtual device cannot run them (the scan runs it on an accelerator only: DEVICE_ONLY)")
        check_config(cfg)
        v = self.v = _vllm()
        D = cfg.num_draft_tokens
        try:
            with tempfile.TemporaryDirectory(prefix="drift-vllm-") as model:
                vc = self.vllm_config = vllm_config(v, cfg, model)
                with v["set_current_vllm_config"](vc):
                    _one_process_world(v)
                    self.runner = (runner_cls or v["runner_cls"])(vc, dev)
                    spec = v["MambaSpec"](block_size=16, shapes=((cfg.num_v_heads, cfg.head_v_dim, cfg.head_k_dim),
                                                                 (cfg.conv_window, cfg.conv_channels)),
                                          dtypes=(cfg.torch_ssm_dtype, cfg.torch_conv_dtype),
                                          mamba_type="gdn_attention", mamba_cache_mode="none",
                                          num_speculative_blocks=D - 1)
                    self.builder = (builder_cls or v["GDNAttentionMetadataBuilder"])(
                        spec, [f"model.layers.{i}.linear_attn" for i in range(cfg.num_layers)], vc, dev)
        except Exception as exc:  # drift could not build vLLM's objects: not a regression of them
            raise LoadError(f"the update {NAME}: building vLLM's config, runner or builder for {cfg.name} raised "
                            f"{exc!r}".replace("\n", " ")[:600]) from exc
        self.harness, self.dev, self._batches = harness, dev, {}
        self.columns = torch.arange(D, device=dev)

    def batch(self, R: int):
        """The scheduler's host-side view of a decode step of ``R`` requests in the harness's ``N`` rows:
        D tokens per request, none per padded row (cached per ``R``); the runner's
        ``num_decode_draft_tokens`` staged for it (D - 1 per request, -1 per padded row)."""
        cfg, D, N = self.cfg, self.cfg.num_draft_tokens, self.cfg.num_rows
        self.runner.num_decode_draft_tokens.np[:R] = D - 1  # _prepare_inputs: draft_len per decode request
        self.runner.num_decode_draft_tokens.np[R:] = -1
        self.runner.num_decode_draft_tokens.copy_to_gpu()
        if R not in self._batches:
            lens = torch.tensor([D] * R + [0] * (N - R), dtype=I32)
            qsl = torch.zeros(N + 1, dtype=I32)
            torch.cumsum(lens, 0, out=qsl[1:])
            seq = torch.full((N,), cfg.prefill_len, dtype=I32)  # read only with prefills or prefix caching
            self._batches[R] = self.v["CommonAttentionMetadata"](
                query_start_loc=qsl.to(self.dev), query_start_loc_cpu=qsl, seq_lens=seq.to(self.dev), num_reqs=N,
                num_actual_tokens=R * D, max_query_len=D, max_seq_len=int(seq.max()),
                block_table_tensor=self.harness.block_table,
                slot_mapping=torch.zeros(R * D, dtype=torch.int64, device=self.dev), seq_lens_cpu_upper_bound=seq)
        return self._batches[R]

    def step(self, harness, last_correct_step_indices: torch.Tensor) -> None:
        """After the verify: the runner's accept counts of the step's ``R`` requests (the harness's
        ``num_spec_decodes``; the fixed batch: every request), then the builder's indices."""
        R = harness.num_spec_decodes
        last = last_correct_step_indices[:R].to(torch.int64)
        # the rejection sampler's output: the accepted tokens (any id but -1), then -1 (PLACEHOLDER_TOKEN_ID)
        out = torch.where(self.columns[None, :] <= last[:, None], 1, -1)
        self.runner._update_states_after_model_execute(out, None)
        self.build(harness, self.runner.num_accepted_tokens.gpu)

    def build(self, harness, accepted: torch.Tensor) -> None:
        """``GDNAttentionMetadataBuilder.build`` over the step's batch (``accepted``: the runner's
        per-row accept counts it reads), its outputs copied into the harness's buffers."""
        N = self.cfg.num_rows
        md = self.builder.build(0, self.batch(harness.num_spec_decodes), num_accepted_tokens=accepted[:N],
                                num_decode_draft_tokens_cpu=self.runner.num_decode_draft_tokens.cpu[:N])
        harness.num_accepted_tokens.copy_(md.num_accepted_tokens[:N])
        harness.spec_state_indices_tensor.copy_(md.spec_state_indices_tensor[:N])


def engine_of(harness, runner_cls=None, builder_cls=None) -> VllmBookkeeping:
    """The :class:`VllmBookkeeping` of ``harness``, built on first use."""
    cache = harness.__dict__.setdefault("_drift_vllm", {})
    key = (runner_cls, builder_cls)
    if key not in cache:
        cache[key] = VllmBookkeeping(harness, runner_cls, builder_cls)
    return cache[key]


def serving_parts(runner_cls=None, builder_cls=None):
    """The serving bookkeeping (drift/flows/in_place/updates.py: ``ServingParts``) with vLLM's own GDN
    builder in the builder's place: under a churning lifecycle the flow forms each step's batch (its
    requests, then the graph bucket's padded rows) and calls it before the verify, as vLLM's
    ``_build_attention_metadata`` does, over the per-row accept counts ``_prepare_inputs`` rebuilt (the
    harness's ``num_accepted_tokens``)."""
    from ..flows.in_place.updates import ServingParts

    def vllm_builder(harness) -> None:
        engine_of(harness, runner_cls, builder_cls).build(harness, harness.num_accepted_tokens.clone())

    return ServingParts(builder=vllm_builder)


def bookkeeping(self, last_correct_step_indices, mamba_track_indices=None, mamba_steps_to_track=None):
    """vLLM 0.33.0's own runner and builder bookkeeping, called as every update is (module docstring)."""
    engine_of(self).step(self, last_correct_step_indices)


bookkeeping.serving = serving_parts()
bookkeeping.DEVICE_ONLY = True  # real device buffers: the host-sync scan runs on an accelerator only
bookkeeping.preflight = check_config


def with_classes(runner_cls=None, builder_cls=None, name: str = "bookkeeping"):
    """The same update over other runner / builder classes (a test's one-line mutants of vLLM's own)."""
    def update(self, last_correct_step_indices, mamba_track_indices=None, mamba_steps_to_track=None):
        engine_of(self, runner_cls, builder_cls).step(self, last_correct_step_indices)
    update.__name__ = update.__qualname__ = name
    update.serving = serving_parts(runner_cls, builder_cls)
    update.DEVICE_ONLY, update.preflight = True, check_config
    return update
