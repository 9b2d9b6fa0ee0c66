"""Every rule a finding can carry: its id, default severity and what it means. SARIF's driver lists these."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Rule:
    id: str
    severity: str
    summary: str
    help: str


RULES: dict[str, Rule] = {
    r.id: r
    for r in (
        Rule(
            "unsafe-global",
            "error",
            "The pickle references a global that is not a tensor-rebuilding one.",
            "Loading this file with torch.load(weights_only=False) would import and possibly call it. "
            "dtypeaudit never does. Re-save the checkpoint as a plain state_dict or safetensors.",
        ),
        Rule(
            "foreign-global",
            "warning",
            "The pickle references a plain data class (argparse.Namespace, Lightning's AttributeDict, numpy scalars).",
            "torch.load(weights_only=True) refuses it unless allow-listed with torch.serialization.add_safe_globals.",
        ),
        Rule(
            "index-mismatch",
            "error",
            "A sharded checkpoint's index and its shards disagree.",
            "Regenerate the index, or re-download the shards it names.",
        ),
        Rule(
            "trailing-data",
            "warning",
            "Bytes follow the pickle that loaders ignore.",
            "A second pickle hidden after the first is a known smuggling trick; its globals are reported too.",
        ),
        Rule(
            "pickled-module",
            "error",
            "The file pickles a whole nn.Module, not a state_dict.",
            "Loading it imports and runs the module's class. Save model.state_dict() and ship that instead.",
        ),
        Rule(
            "loader-divergence",
            "info",
            "A loader might read this file differently from dtypeaudit (for example torch.load(weights_only=True) refuses it).",
            "Loading it then takes weights_only=False, which trusts the file. Re-save with torch.save's defaults; "
            "scan --strict fails on this.",
        ),
        Rule(
            "unused-weights",
            "warning",
            "A model directory holds weight files that from_pretrained would not load.",
            "Delete the stale files or fix the index: what is audited should be what loads. scan --strict fails on this.",
        ),
        Rule("unreadable", "error", "The checkpoint could not be read.", "The message says why; fix or re-download the file."),
        Rule(
            "dtype-mismatch",
            "error",
            "A tensor's dtype is not what the policy expects.",
            "Convert the checkpoint (dtypeaudit convert) or change the policy rule that matched; --explain NAME shows which.",
        ),
        Rule(
            "module-dtype-mix",
            "error",
            "Tensors of one module disagree in floating dtype in a way PyTorch's kernel refuses.",
            "Linear and Conv need weight and bias in one dtype; BatchNorm, LayerNorm and GroupNorm need weight, bias and "
            "running statistics in one dtype (an fp16 BatchNorm with fp32 statistics fails with 'expected scalar type Half "
            "but found Float'). Convert the module's floating tensors together. A module of unknown kind is a warning.",
        ),
        Rule(
            "dtype-outlier",
            "warning",
            "A module's dtype differs from the model's dominant dtype in a way a forward pass does not survive.",
            "A Linear or Conv needs its input in its own dtype and an Embedding hands its own dtype on, so one left in "
            "float32 inside a float16 model fails ('mat1 and mat2 must have the same dtype'). Norm layers entirely in "
            "float32 are fine: they take half input. A warning when module kinds are guessed from names and shapes; "
            "an error with --model when the module type's rule is known.",
        ),
        Rule(
            "unused-rule",
            "warning",
            "A policy rule or ignore pattern decides no tensor in any checkpoint of the run.",
            "Its pattern matches nothing (globs match whole dotted names or tails after a dot; ^ anchors), an earlier "
            "rule decides every tensor it matches, or it selects by module without --model. Fix it, or mark it optional: true.",
        ),
        Rule(
            "model-mismatch",
            "error",
            "Fewer than half of the checkpoint's model tensors match a name of the --model factory.",
            "Kinds and module rules would apply to a few tensors in silence. Give the factory of the model the checkpoint "
            "was saved from; the message shows the prefix that comes closest.",
        ),
        Rule(
            "tied-dtype-conflict",
            "error",
            "Tensors that share storage are required to have different dtypes.",
            "Tied weights are one tensor: give their names the same expected dtype in the policy.",
        ),
        Rule(
            "config-dtype-mismatch",
            "warning",
            "config.json's torch_dtype disagrees with the weights.",
            "Update config.json's torch_dtype (or dtype) to the dtype the weights hold.",
        ),
        Rule(
            "fp16-overflow",
            "error",
            "Values beyond float16's range (+-65504) would become inf.",
            "Use bfloat16, keep the tensor in float32 (--keep-unsafe) or saturate (--clamp).",
        ),
        Rule(
            "fp16-underflow",
            "warning",
            "Non-zero values below float16's smallest subnormal (2^-24) would become zero.",
            "Use bfloat16 or keep the tensor in float32.",
        ),
        Rule(
            "fp16-subnormal",
            "info",
            "Values in float16's subnormal range lose precision.",
            "Usually harmless; keep the tensor in float32 if its small values matter.",
        ),
        Rule("non-finite", "error", "The tensor already holds NaN or Inf.", "Find where training diverged; the values are lost."),
    )
}


def rule(rule_id: str) -> Rule:
    return RULES.get(rule_id) or Rule(rule_id, "error", rule_id, "")
