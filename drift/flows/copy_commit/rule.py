"""The copy-commit kind's verify rule: sgl-kernel-npu's ``recurrent_gated_delta_rule`` as SGLang
0.5.23 calls it (docs/semantics.md §5-§6)."""

from __future__ import annotations

from ...sim.kernels import Plan, VerifyArgs, VerifyRule


class NpuRule(VerifyRule):
    """Row b starts from ``i = ssm_state_indices[b, num_accepted[b] - 1]``: the committed state
    ``recurrent_state[cache_indices[b]]`` when ``i % S == 0`` (the row's first block), else scratch
    block ``i``; the state after every token t is stored into scratch block ``ssm_state_indices[b, t]``.
    With SGLang's arguments (ones, arange) every row starts from its committed state; the
    ``npu-accepted`` flow's accept counts continue a row from its previous scratch block."""

    name = "npu"

    def plan(self, args: VerifyArgs) -> Plan:
        S = args.mix_qkv.shape[2]
        start = args.accepted_index()
        return Plan(start=start, from_committed=(start % S) == 0, dest=args.ssm_state_indices.to(start.dtype))
