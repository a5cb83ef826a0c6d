"""Type tokens of geotrain's components: one place for the program, the policy pack and
the tests (`geotrain:<module>:<Name>`)."""

POOL = "geotrain:pool:RegionPool"
OVERLAY = "geotrain:network:Overlay"
ROUTING = "geotrain:routing:Routing"
MONITORING = "geotrain:monitoring:Monitoring"
TRAINING = "geotrain:training:TrainingDeployment"
ALL = (POOL, OVERLAY, ROUTING, MONITORING, TRAINING)
