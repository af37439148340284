"""moefq's quantizers as torch.nn.Modules, to put into a model's MoE, and (from moefq.hf) quantize_moe /
restore_moe, which put them into every MoE block of a Hugging Face model, and capture_moe_inputs, which
records a Hugging Face model's MoE inputs into the activations file `moefq eval --activations` reads.

DispatchQuantizer sits where the tokens leave for the experts (x -> QDQ(x)); CombineQuantizer
replaces the sum of the weighted expert outputs (rows [K, T, H] -> one bf16 row per token), the
combine quantizer of moefq.combine_qdq_resum. Both hold a moefq.Quantizer: calibrate (max |x|),
enable/disable, amax, save/load of the project's calibration file. Gradients pass straight through
the QDQ (the straight-through estimator), so a model keeps training with them inside.
"""

__all__ = ["DispatchQuantizer", "CombineQuantizer", "capture_moe_inputs", "find_moe_blocks", "moe_block_paths",
           "quantize_moe", "restore_moe", "MoeQuantization"]

from ._modules import CombineQuantizer, DispatchQuantizer
from .hf import MoeQuantization, capture_moe_inputs, find_moe_blocks, moe_block_paths, quantize_moe, restore_moe
