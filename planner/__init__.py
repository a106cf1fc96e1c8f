"""canzona's planner: from a model description to a schedule file, without torch.

`sources` turns a model (preset, Hugging Face config, parameter file) into a `ModelSpec`;
`partition` prices parameters and cuts buffers across DP ranks and TP micro-groups; `plan`
runs those steps and `compile` writes the result as a `Schedule`; `predict` prices a schedule's
step on a hardware model. Shared types live in `spec`.
"""
