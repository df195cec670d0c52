"""Updates that are not back-propagation: Contrastive Divergence (`troupe.cd`, SINGA's ``alg: kCD``)."""
