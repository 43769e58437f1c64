"""Training under context parallelism: CP-sharded batches (:mod:`megacp.placement.batch`) and the
CP-exact causal-LM loss (:mod:`megacp.train.loss`)."""
