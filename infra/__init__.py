"""geotrain infrastructure: stack model -> plan -> render -> Pulumi components."""
