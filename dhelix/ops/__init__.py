"""Operator programs: a megatron-core TransformerLayer as explicit forward and backward
operator programs (`layer_program`), their registry (`registry`), and their op-by-op
execution on the layer's own parameters (`runner`). See docs/operator_programs.md."""
