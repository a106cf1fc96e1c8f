"""The communication of a step: collectives under a timeout, the DP gradient reduction and parameter
gather bucket by bucket, the TP micro-group pipeline, and the reduced gradients with their norm."""
