"""The geotrain PolicyPack. Only here: PolicyPack() starts the analyzer server and never
returns, so nothing else may import this module.

    pulumi preview --policy-pack policies [--policy-pack-config policy-config.json]

`geotrain check --stack S --emit-config policy-config.json` writes the config that
matches a stack's `geotrain:policy` settings.
"""

from pulumi_policy import EnforcementLevel, PolicyPack

from policies.rules import ALL

PolicyPack(
    name="geotrain",
    policies=ALL,
    enforcement_level=EnforcementLevel.MANDATORY,
    description="Guardrails for cross-border training: residency, encryption, "
    "exposure, budget, checkpoints, tags, network integrity.",
)
