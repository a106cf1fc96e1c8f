"""What the user asks the planner for, `PlanRequest`, and how a schedule records it.

One frozen dataclass: the CLI builds it with keywords, the planner plans from it, and it writes
itself into a schedule's `request` section (`to_request`) and is read back from one
(`from_request`). The pydantic `Request` in `canzona.schedules.format` stays the file format.
"""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass, field, fields
from importlib import metadata

from canzona.planner.partition.cooperative import COOP_MODES
from canzona.planner.partition.costs import OptimizerConfig
from canzona.planner.partition.layout import DEFAULT_BUCKET_SIZE
from canzona.planner.spec import DEFAULT_GLOBAL_BATCH, DEFAULT_SEQ_LEN, ModelOptions, ModelSpec, PlanError
from canzona.schedules.format import ModelSource, OptimizerSettings, Request, TrainingSettings
from canzona.schedules.limits import (
    DEFAULT_GROUP_MB,
    FSDP,
    REPLICATED,
    REPLICATED_UPDATE,
    TP_UPDATE_REQUESTS,
    choice_problem,
    optimizer_problem,
    recorded_settings,
    request_problem,
    sharding_problem,
)

# PlanRequest fields a schedule records in sections of their own, or flattened (`options`).
_NESTED = ("model", "optimizer", "options", "training")
_OPTION_FIELDS = tuple(f.name for f in fields(ModelOptions))


def canzona_version() -> str:
    """Installed package version (recorded in every schedule)."""
    try:
        return metadata.version("canzona")
    except metadata.PackageNotFoundError:
        return "0+unknown"


@dataclass(frozen=True)
class TrainingSetup:
    """What one training iteration processes, for predictions of the whole iteration:
    `global_batch` sequences of `seq_len` tokens per optimizer step over all DP ranks, in
    `micro_batches` forward/backward passes per DP rank (None: one sequence per micro-batch,
    i.e. global_batch / dp, Megatron's usual micro-batch size 1)."""

    global_batch: int = DEFAULT_GLOBAL_BATCH
    seq_len: int = DEFAULT_SEQ_LEN
    micro_batches: int | None = None

    def check_values(self) -> None:
        """PlanError unless every value is a positive count (what needs no schedule to check)."""
        if self.global_batch < 1 or self.seq_len < 1:
            raise PlanError(
                f"global batch and sequence length must be >= 1, got {self.global_batch} and {self.seq_len}"
            )
        if self.micro_batches is not None and self.micro_batches < 1:
            raise PlanError(f"micro-batches must be >= 1, got {self.micro_batches}")

    def validate(self, dp: int) -> int:
        """The micro-batch count per DP rank; PlanError unless the batch splits evenly."""
        self.check_values()
        count = self.micro_batches if self.micro_batches is not None else self.global_batch // dp
        if count < 1 or self.global_batch % (dp * count):
            raise PlanError(
                f"a global batch of {self.global_batch} sequences does not split into dp {dp} x "
                f"{count if count >= 1 else 'any'} micro-batches of whole sequences; give --global-batch "
                "(a multiple of dp) or --micro-batches"
            )
        return count


def default_global_batch(dp: int) -> int:
    """The default global batch for `dp` ranks: `DEFAULT_GLOBAL_BATCH` sequences, rounded up to
    a multiple of dp so that every rank gets whole sequences."""
    return -(-DEFAULT_GLOBAL_BATCH // dp) * dp


DEFAULT_TRAINING = TrainingSetup()  # one instance serves every default: TrainingSetup is frozen


@dataclass(frozen=True)
class PlanRequest:
    """What the user asked for; recorded in the schedule so it can be regenerated. Only the
    model and the layout may be given by position; everything else by keyword."""

    model: str
    tp: int
    dp: int
    _: KW_ONLY
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    cost: str = "flops"
    alpha: float = 1.0
    bucket_size: int = DEFAULT_BUCKET_SIZE
    options: ModelOptions = field(default_factory=ModelOptions)
    tp_mode: str = "rollback"
    group_bytes: int = DEFAULT_GROUP_MB << 20
    ep: int = 1
    solver: str = "greedy"
    time_limit: float = 10.0
    seed: int = 0
    alpha_device: str | None = None  # set: alpha was chosen by the simulator on this device
    bucket_device: str | None = None  # set: bucket_size was chosen by the simulator on this device
    training: TrainingSetup | None = None  # what those searches assumed (None: the defaults)
    sharding: str = REPLICATED  # or FSDP: FSDP2 fully_shard (planner/fsdp.py)
    dp_replicate: int = 1  # HSDP (FSDP only): dp = dp_replicate x shard ranks
    coop: str = "auto"  # cooperative hosting of dominant Muon matrices: off, auto, force
    # "free": the planner picks each bucket's parameter order (canzona's runtimes pack by the
    # schedule); "registration": Megatron's fixed gradient buffer. None resolves to free, or to
    # registration under --solver ilp (CP-SAT refines registration-order plans only).
    order: str | None = None
    # How the TP group updates a DP rank's matrices (`canzona.schedules.limits.TP_UPDATES`):
    # "auto" lets the objective pick hosted micro-groups or the replicated (TP-SC) update.
    tp_update: str = "auto"

    def __post_init__(self) -> None:
        if self.order is None:
            # CP-SAT refines contiguous cuts; FSDP plans have no buckets to order.
            fixed = self.solver == "ilp" or self.sharding == FSDP
            object.__setattr__(self, "order", "registration" if fixed else "free")

    @property
    def searching(self) -> bool:
        """Whether the simulator chooses α or the bucket size (`--alpha auto`, `--bucket-size auto`)."""
        return self.alpha_device is not None or self.bucket_device is not None

    def validate(self) -> None:
        """Raise PlanError on a layout or setting no plan can have (canzona's limits)."""
        opt = self.optimizer
        problem = request_problem(
            tp=self.tp,
            dp=self.dp,
            ep=self.ep,
            alpha=self.alpha,
            bucket_size=self.bucket_size,
            group_bytes=self.group_bytes,
            tp_mode=self.tp_mode,
            solver=self.solver,
            time_limit=self.time_limit,
            seed=self.seed,
            order=self.order,
        ) or optimizer_problem(opt)
        problem = (
            problem or sharding_problem(self.sharding, self.dp, self.dp_replicate, self.ep) or self._fsdp_problem()
        )
        if problem:
            raise PlanError(problem)
        if self.coop not in COOP_MODES:
            raise PlanError(f"unknown cooperative hosting mode {self.coop!r}; choose one of {', '.join(COOP_MODES)}")
        problem = choice_problem("TP update", self.tp_update, TP_UPDATE_REQUESTS)
        if problem:
            raise PlanError(problem)
        if self.searching:
            (self.training or TrainingSetup()).validate(self.dp)

    def _fsdp_problem(self) -> str | None:
        """What FSDP plans do not have: DP cuts (alpha), buckets, CP-SAT refinement."""
        if self.sharding != FSDP:
            return None
        if self.searching:
            return "--alpha auto and --bucket-size auto search DP cuts and buckets, which FSDP plans do not have"
        if self.alpha != 1.0 or self.bucket_size != DEFAULT_BUCKET_SIZE:
            return "alpha and the bucket size shape DP cuts and buckets, which FSDP plans do not have; leave them out"
        if self.solver != "greedy":
            return "--solver ilp is not supported with --fsdp (FSDP plans use the greedy micro-group scheduler)"
        if self.coop == "force":
            return "--coop force is not supported with --fsdp (FSDP plans host every matrix on one device)"
        if self.tp_update == REPLICATED_UPDATE:
            return "--tp-update replicated is not supported with --fsdp (FSDP plans host every matrix on one device)"
        return None

    def to_request(self, model: ModelSpec) -> Request:
        """The schedule's `request` section for a plan of `model` (the model source as loaded,
        with its name and sha256): what regenerates the schedule."""
        flat = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in _NESTED}
        settings = {key: value for key, value in vars(self.optimizer).items() if key != "name"}
        return Request(
            model=ModelSource(name=model.name, source=model.source, sha256=model.source_sha256),
            optimizer=OptimizerSettings.model_validate(
                {"name": self.optimizer.name, **recorded_settings(self.optimizer.name, settings)}
            ),
            training=self._training_settings(),
            canzona_version=canzona_version(),
            **vars(self.options),
            **flat,
        )

    def _training_settings(self) -> TrainingSettings | None:
        """The training setup an automatic search assumed (none without a search)."""
        if not self.searching:
            return None
        setup = self.training or TrainingSetup()
        return TrainingSettings(
            global_batch=setup.global_batch, seq_len=setup.seq_len, micro_batches=setup.micro_batches
        )

    @classmethod
    def from_request(cls, request: Request, model_source: str | None = None) -> PlanRequest:
        """The request a schedule records, to plan again (the inverse of `to_request`);
        `model_source` overrides where the model is read from (e.g. a path resolved next to
        the file)."""
        flat = request.model_dump(exclude={*_NESTED, *_OPTION_FIELDS, "canzona_version"})
        return cls(
            model=model_source or request.model.source,
            optimizer=OptimizerConfig(**request.optimizer.model_dump()),
            options=ModelOptions(**request.model_dump(include=set(_OPTION_FIELDS))),
            training=TrainingSetup(**request.training.model_dump()) if request.training else None,
            **flat,
        )
