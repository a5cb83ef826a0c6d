"""geotrain's training runtime: reads a launch spec, never imports pulumi or infra."""
