"""The geotrain Pulumi program: read the stack model, wire the components."""

from infra.model.pulumi_config import model_from_pulumi
from infra.program import program

program(model_from_pulumi())
