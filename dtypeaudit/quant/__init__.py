"""Quantized checkpoints: storage tensors grouped into logical weights (:mod:`.model`, :mod:`.group`),
their consistency checks (:mod:`.checks`), and the dequantizers conversion streams through."""
