"""Every rule a finding can carry: its id, default severity and what it means. SARIF's driver lists these."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FindingRule:
    """A kind of finding: its id, default severity, what it means and what to do (SARIF reportingDescriptor)."""

    id: str
    severity: str
    summary: str
    help: str


RULES: dict[str, FindingRule] = {
    r.id: r
    for r in (
        FindingRule(
            "unsafe-global",
            "error",
            "The pickle references a global that is not a tensor-rebuilding one.",
            "Loading this file with torch.load(weights_only=False) would import and possibly call it. "
            "dtypeaudit never does. Re-save the checkpoint as a plain state_dict or safetensors.",
        ),
        FindingRule(
            "foreign-global",
            "warning",
            "The pickle references a plain data class (argparse.Namespace, Lightning's AttributeDict, numpy scalars).",
            "torch.load(weights_only=True) refuses it unless allow-listed with torch.serialization.add_safe_globals.",
        ),
        FindingRule(
            "index-mismatch",
            "error",
            "A sharded checkpoint's index and its shards disagree.",
            "Regenerate the index, or re-download the shards it names.",
        ),
        FindingRule(
            "trailing-data",
            "warning",
            "Bytes follow the pickle that loaders ignore.",
            "A second pickle hidden after the first is a known smuggling trick; its globals are reported too.",
        ),
        FindingRule(
            "pickled-module",
            "error",
            "The file pickles a whole nn.Module, not a state_dict.",
            "Loading it imports and runs the module's class. Save model.state_dict() and ship that instead.",
        ),
        FindingRule(
            "loader-divergence",
            "warning",
            "A loader might read this file differently from dtypeaudit (for example torch.load(weights_only=True) refuses it).",
            "Loading it then takes weights_only=False, which trusts the file. Re-save with torch.save's defaults; "
            "scan --strict fails on this.",
        ),
        FindingRule(
            "load-cast",
            "warning",
            "from_pretrained loads a tensor in another dtype than the one stored (the config's dtype, keep-in-fp32 modules).",
            "The policy is checked against the dtypes the loaded model has; the stored dtype is reported beside it. Set the "
            "config's dtype to what the weights hold, or convert the weights to what the config says.",
        ),
        FindingRule(
            "duplicate-key",
            "warning",
            "A JSON file the loader reads (config.json, an index) lists a key twice; the loader keeps the last value.",
            "dtypeaudit reads the value the loader keeps. Remove the duplicate so that every reader agrees.",
        ),
        FindingRule(
            "keep-in-fp32-unknown",
            "info",
            "The model class named in config.json is not in dtypeaudit's table of transformers' classes "
            "(data/transformers.json), so its keep-in-fp32 modules are unknown.",
            "A class of your own code, or one newer than the table's transformers version: regenerate the table "
            "(scripts/generate_transformers_table.py), or audit the loaded model (dtypeaudit.audit).",
        ),
        FindingRule(
            "load-renamed",
            "info",
            "from_pretrained loads some tensors under other names than the stored ones (transformers 5's conversion mapping).",
            "The policy is checked against the loaded names; the report's metadata lists each stored name beside its loaded one.",
        ),
        FindingRule(
            "load-conversion-unmodelled",
            "warning",
            "from_pretrained merges or splits some stored tensors into others (a WeightConverter, e.g. fused MoE experts); "
            "dtypeaudit does not model that conversion.",
            "The stored tensors are judged under their stored names; check the loaded model's tensors with a live audit "
            "(dtypeaudit.audit on the loaded model).",
        ),
        FindingRule(
            "load-names-unknown",
            "info",
            "dtypeaudit's table of transformers' classes has no built model of the class config.json names (not in the "
            "table, or its default config does not build), so the names from_pretrained gives the tensors and its "
            "sub-models' keep-in-fp32 modules are unknown.",
            "The message says why and which transformers version the table came from; regenerate the table "
            "(scripts/generate_transformers_table.py) for a newer one, or audit the loaded model (dtypeaudit.audit).",
        ),
        FindingRule(
            "load-names-unmatched",
            "error",
            "Stored names the model class config.json names does not take (from_pretrained drops them), or weights of "
            "the class no stored tensor fills (initialised at random): an error where most of the model gets no tensor.",
            "The class's names come from dtypeaudit's table of transformers' classes; tied weights count as filled. A "
            "DistributedDataParallel `module.` (or torch.compile `_orig_mod.`) prefix: save the unwrapped model, or strip "
            "the prefix from each key and save again. Another model's names: name the right class in config.json's architectures.",
        ),
        FindingRule(
            "left-out",
            "info",
            "Files in a folder that no modelled loader would read, or that --exclude names, were not scanned.",
            "The note lists each file and why. Use --exclude only for files nobody loads.",
        ),
        FindingRule(
            "training-state",
            "info",
            "A Trainer checkpoint's training state beside the weights (optimizer.pt, scheduler.pt, rng_state.pth, "
            "trainer_state.json ...): read for safety, not loaded as the model.",
            "Trainer.train(resume_from_checkpoint=...) reads it; convert carries it unchanged. A policy's "
            "region: optimizer rules (amp-training's) judge optimizer.pt's state.",
        ),
        FindingRule(
            "followed-link",
            "info",
            "A symlink in the folder leads outside it; the file it leads to was read.",
            "Loaders follow the link too. Copy the file into the folder to make the checkpoint self-contained.",
        ),
        FindingRule(
            "shadowed-method",
            "error",
            "A tensor's pickled state sets an attribute named like a Tensor method (half, to, float ...).",
            "Code that calls that method on the loaded tensor gets the attribute instead. convert refuses to carry it "
            "forward; re-save the tensors without their state.",
        ),
        FindingRule(
            "unused-weights",
            "warning",
            "A model directory holds weight files that from_pretrained would not load.",
            "Delete the stale files or fix the index: what is audited should be what loads. scan --strict fails on this.",
        ),
        FindingRule("unreadable", "error", "The checkpoint could not be read.", "The message says why; fix or re-download the file."),
        FindingRule(
            "dtype-mismatch",
            "error",
            "A tensor's dtype is not what the policy expects.",
            "Convert the checkpoint (dtypeaudit convert) or change the policy rule that matched; --explain NAME shows which.",
        ),
        FindingRule(
            "module-dtype-mix",
            "error",
            "Tensors of one module disagree in floating dtype in a way PyTorch's kernel refuses.",
            "Linear and Conv need weight and bias in one dtype; BatchNorm, LayerNorm and GroupNorm need weight, bias and "
            "running statistics in one dtype (an fp16 BatchNorm with fp32 statistics fails with 'expected scalar type Half "
            "but found Float'). Convert the module's floating tensors together. A module of unknown kind is a warning.",
        ),
        FindingRule(
            "dtype-outlier",
            "warning",
            "A module's dtype differs from the model's dominant dtype in a way a forward pass does not survive.",
            "A Linear or Conv needs its input in its own dtype and an Embedding hands its own dtype on, so one left in "
            "float32 inside a float16 model fails ('mat1 and mat2 must have the same dtype'). Norm layers entirely in "
            "float32 are fine: they take half input. A warning when module kinds are guessed from names and shapes; "
            "an error with --model when the module type's rule is known.",
        ),
        FindingRule(
            "unused-rule",
            "warning",
            "A policy rule or ignore pattern decides no tensor in any checkpoint of the run.",
            "Its pattern matches nothing (globs match whole dotted names or tails after a dot; ^ anchors), an earlier "
            "rule decides every tensor it matches, or it selects by module without --model. Fix it, or mark it optional: true.",
        ),
        FindingRule(
            "model-mismatch",
            "error",
            "Fewer than half of the checkpoint's model tensors match a name of the --model factory.",
            "Kinds and module rules would apply to a few tensors in silence. Give the factory of the model the checkpoint "
            "was saved from; the message shows the prefix that comes closest.",
        ),
        FindingRule(
            "tied-dtype-conflict",
            "error",
            "Tensors that share storage are required to have different dtypes.",
            "Tied weights are one tensor: give their names the same expected dtype in the policy.",
        ),
        FindingRule(
            "config-dtype-mismatch",
            "warning",
            "config.json's torch_dtype disagrees with the weights.",
            "Update config.json's torch_dtype (or dtype) to the dtype the weights hold.",
        ),
        FindingRule(
            "fp16-overflow",
            "error",
            "Values beyond float16's range (+-65504) would become inf.",
            "Use bfloat16, keep the tensor in float32 (--keep-unsafe) or saturate (--clamp).",
        ),
        FindingRule(
            "fp16-underflow",
            "warning",
            "Non-zero values below float16's smallest subnormal (2^-24) would become zero.",
            "Use bfloat16 or keep the tensor in float32.",
        ),
        FindingRule(
            "fp16-subnormal",
            "info",
            "Values in float16's subnormal range lose precision.",
            "Usually harmless; keep the tensor in float32 if its small values matter.",
        ),
        FindingRule("non-finite", "error", "The tensor already holds NaN or Inf.", "Find where training diverged; the values are lost."),
        FindingRule(
            "unsupported-dtype",
            "error",
            "The hardware target (--target, or the policy's target) cannot compute this floating dtype.",
            "For example fp8 before NVIDIA compute capability 8.9, float64 on Apple's MPS, OCP fp8 on AMD MI300 (which computes "
            "the FNUZ variants). Convert to the dtype the message suggests; `dtypeaudit targets NAME` shows the target's row.",
        ),
        FindingRule(
            "emulated-dtype",
            "warning",
            "The hardware target runs this floating dtype only through conversions to a wider type, at a fraction of the speed.",
            "For example bfloat16 on a V100 or T4 (no bf16 tensor cores before compute capability 8.0), or float16 on a CPU "
            "without AVX512-FP16. Use the dtype the message suggests (float16 on those GPUs).",
        ),
        FindingRule(
            "dtype-drift",
            "warning",
            "A live tensor's dtype changed since the previous audit (dtypeaudit.audit's Auditor, the training callbacks).",
            "A .to()/.half() applied to part of a model, or an optimizer or hook that rewrites parameters, shows up this way; "
            "a changed torch.get_default_dtype() too. Find the cast; drift_severity='error' makes drift fail the run.",
        ),
        FindingRule(
            "batch-dtype",
            "warning",
            "A floating tensor of the batch has another dtype than the model's first layer.",
            "A Linear or Conv fails on input of another dtype ('mat1 and mat2 must have the same dtype'), and a float64 target "
            "makes the loss run in float64. Cast the batch where it is loaded (numpy arrays become float64 tensors).",
        ),
        FindingRule(
            "default-dtype",
            "error",
            "torch.get_default_dtype() is not the policy's default_dtype.",
            "A torch.set_default_dtype call changes the dtype of every layer built afterwards and of torch.tensor(1.0); reset "
            "it, or build the model before changing it.",
        ),
        FindingRule(
            "runtime-dtype-error",
            "error",
            "An operation of the traced forward or backward pass fails with these dtypes (dtypeaudit trace).",
            "The message is PyTorch's own, from the CPU kernel ('mat1 and mat2 must have the same dtype', 'expected scalar type "
            "Half but found Float'). Give the module's weights, biases, statistics and inputs one dtype, or run under autocast. "
            "The trace goes on with the inputs in the dtype the module's weight has, so every failure is listed.",
        ),
        FindingRule(
            "implicit-promotion",
            "warning",
            "A half-precision tensor meets a wider one in an operation and the result is silently wider (dtypeaudit trace).",
            "An fp32 bias or buffer added to fp16 activations makes everything after it fp32: the memory and speed of half "
            "precision are lost without an error. Cast the wider operand, or list the module with --allow-promotion if "
            "it is meant (an fp32 norm).",
        ),
        FindingRule(
            "low-precision-reduction",
            "warning",
            "A softmax, sum, mean, norm, variance or loss is computed and returned in float16 or bfloat16 (dtypeaudit trace).",
            "float16 overflows past 65504 and bfloat16 keeps 8 bits of mantissa, so long sums go wrong. Compute it in "
            "float32 (softmax(x, dim, dtype=torch.float32), x.float().sum()), as autocast does for the reductions it lists.",
        ),
        FindingRule(
            "autocast-fp32",
            "info",
            "autocast runs this operation in float32, casting its half-precision inputs up (dtypeaudit trace --autocast).",
            "Expected for the operations autocast keeps in float32 (losses, norms and others, per device); the cost is a cast "
            "and float32 activations. The trace follows CPU autocast's lists.",
        ),
        FindingRule(
            "loss-dtype",
            "warning",
            "The loss is computed in float16 or bfloat16 (dtypeaudit trace --backward); info when float32.",
            "A float16 loss needs loss scaling (torch.amp.GradScaler) or its small gradients underflow to zero; compute the loss "
            "from logits.float().",
        ),
        FindingRule(
            "grad-dtype",
            "warning",
            "A parameter gets float16 gradients, or no gradient at all (dtypeaudit trace --backward).",
            "float16 gradients need loss scaling and float32 master weights (torch.amp, apex O2). A parameter without a "
            "gradient is never trained, and DistributedDataParallel needs find_unused_parameters=True for it. bfloat16 "
            "gradients are info.",
        ),
        FindingRule(
            "checkpoint-missing",
            "warning",
            "A parameter or buffer of the traced model is not in the --checkpoint (dtypeaudit trace).",
            "It keeps the dtype the factory gave it. load_state_dict(strict=True) refuses such a checkpoint; check that the "
            "factory builds the model the checkpoint was saved from.",
        ),
        FindingRule(
            "no-quantized-weights",
            "error",
            "The policy is for quantized checkpoints (requires_quantized: fp8-serving), and the checkpoint holds no "
            "quantized weight at all.",
            "A serving preset for a quantized format expects its weights quantized. Quantize the model first, or check it "
            "against a policy for the dtype it holds (--preset bf16, fp16).",
        ),
        FindingRule(
            "quant-missing-scale",
            "error",
            "A quantized weight's scale, zero point or quantization state is not stored.",
            "Nothing can dequantize it correctly: transformers dequantizing an FP8 checkpoint on CPU casts the float8 values "
            "unscaled and reports no missing key. Re-export the checkpoint with every companion tensor.",
        ),
        FindingRule(
            "quant-scale-shape",
            "error",
            "A scale, zero-point or index tensor does not fit the scheme's block or group size and the weight's shape.",
            "The loader refuses it (a size mismatch) or scales the wrong blocks. Check weight_block_size / group_size in "
            "quantization_config against the tensors.",
        ),
        FindingRule(
            "quant-scale-dtype",
            "warning",
            "A scale or packed tensor is stored in a dtype the scheme's loader does not allocate.",
            "The loader casts it on load (a scale already rounded to half precision stays rounded) or misreads packed bits.",
        ),
        FindingRule(
            "quant-ignored-module",
            "warning",
            "A module quantization_config keeps unquantized is stored quantized, or one it quantizes is stored unquantized.",
            "The config and the tensors disagree on what the layer is; a loader that follows the config loads the other "
            "kind of tensor into it. Fix ignore / modules_to_not_convert, or re-export the module.",
        ),
        FindingRule(
            "quant-config-mismatch",
            "error",
            "config.json's quantization_config names a method or parameters the stored tensors contradict.",
            "from_pretrained builds layers for the config's scheme and cannot read the tensors as stored.",
        ),
    )
}


def rule(rule_id: str) -> FindingRule:
    return RULES.get(rule_id) or FindingRule(rule_id, "error", rule_id, "")
