"""The config's fixed sections (``[run]``, ``[train]``, ``[eval]``, ``[privacy]``, ``[init]``, ``[engine]``,
``[[stages]]``) and the component specs every registered part is written with; ``fedsight.config`` assembles them
into the config model and loads configs."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, create_model, field_validator, model_validator

from . import registry as R
from .central_dp import CentralDPSection
from .registry import Params

#: the partition section's keys that are not the partitioner's parameters (kept when partition.name changes)
PARTITION_KEYS = ("num_clients", "local_test_fraction", "rgb_shift", "global_imbalance")


# -- component specs -------------------------------------------------------------------------------

_SPEC_CACHE: dict[tuple, Any] = {}


def _name_to_table(value: Any) -> Any:
    return {"name": value} if isinstance(value, str) else value


def spec_type(registry: R.Registry[Any], extra: dict[str, Any] | None = None) -> Any:
    """A pydantic type accepting ``{"name": <registered name>, **params}`` (or a bare name)."""
    key = (registry.kind, tuple(registry.names()), tuple(sorted((extra or {}).keys())))
    if key in _SPEC_CACHE:
        return _SPEC_CACHE[key]
    members = []
    for entry in registry.entries():
        fields: dict[str, Any] = {"name": (Literal[entry.name], ...)}
        fields.update(extra or {})
        cls_name = "".join(p.capitalize() for p in f"{registry.kind} {entry.name}".replace("_", " ").split())
        members.append(create_model(cls_name, __base__=entry.params, **fields))
    if not members:
        def _none(value: Any) -> Any:
            raise ValueError(f"no {registry.kind} is registered")

        typ: Any = Annotated[Any, BeforeValidator(_none)]
    elif len(members) == 1:
        typ = Annotated[members[0], BeforeValidator(_name_to_table)]
    else:
        typ = Annotated[Union[tuple(members)], Field(discriminator="name"), BeforeValidator(_name_to_table)]
    _SPEC_CACHE[key] = typ
    return typ


# -- sections --------------------------------------------------------------------------------------


class RunSection(Params):
    name: str = Field("run", min_length=1, pattern=r"^[A-Za-z0-9._+\-\[\]=,]+$",
                      description="the run's name: its folder under output_dir")
    output_dir: str = Field("runs", description="folder of the run directories (output_dir/name/[variant/]seedN)")
    checkpoint_keep: int = Field(2, ge=0, description="checkpoints kept on disk (0 = all)")
    tensorboard: bool = Field(False, description="also write TensorBoard event files to RUN_DIR/tensorboard")
    mlflow: bool = Field(False, description="also track the run with MLflow (metrics, config, tags, plots); store: "
                         "RUN_DIR/mlflow unless mlflow_uri")
    mlflow_uri: str | None = Field(None, min_length=1, description="MLflow tracking URI instead of RUN_DIR/mlflow "
                                   "(a server, sqlite:///runs/mlflow.db): a store a sweep's runs share")
    mlflow_experiment: str = Field("fedsight", min_length=1, description="the MLflow experiment the run is logged to")
    plots: bool = Field(True, description="draw RUN_DIR/plots/ (curves.png, the task's visuals, the client weights) "
                        "when the run finishes; false: summary.md and its tables only (`fedsight report RUN_DIR "
                        "--out DIR` draws the curves any time)")

    @field_validator("tensorboard")
    @classmethod
    def _tensorboard_installed(cls, v: bool) -> bool:
        from .tensorboard import available

        if v and not available():
            raise ValueError("needs the tensorboard package: pip install 'fedsight[tensorboard]'")
        return v

    @field_validator("mlflow")
    @classmethod
    def _mlflow_installed(cls, v: bool) -> bool:
        from .mlflow_tracking import available

        if v and not available():
            raise ValueError("needs the mlflow extra: pip install 'fedsight[mlflow]'")
        return v

    @model_validator(mode="after")
    def _mlflow_settings_only_with_mlflow(self) -> "RunSection":
        for key in ("mlflow_uri", "mlflow_experiment"):
            if not self.mlflow and getattr(self, key) != type(self).model_fields[key].default:
                raise ValueError(f"run.{key} is set but run.mlflow = false (nothing is tracked); set run.mlflow = "
                                 f"true or remove run.{key}")
        return self

    @field_validator("name")
    @classmethod
    def _inside_output_dir(cls, v: str) -> str:
        if set(v) <= {"."}:
            raise ValueError(f"{v!r} is not a run name: the run directory would leave output_dir")
        return v


class TrainSection(Params):
    """Local training: ``epochs`` passes, a fixed number of ``steps``, or a number of steps drawn per round
    and client from ``steps_range = [low, high]`` (heterogeneous local work), with the local ``optimizer``
    (SGD, Adam or AdamW, moments fresh every round) and a learning-rate schedule within each round
    (``poly``) or across rounds (``step``, ``cosine``); ``fedsight.training.local.LocalTraining`` has the
    semantics."""

    epochs: int | None = Field(None, ge=1, description="local passes over a client's data a round (or steps)")
    steps: int | None = Field(None, ge=1, description="local optimizer steps a round (instead of epochs)")
    steps_range: tuple[Annotated[int, Field(ge=1)], Annotated[int, Field(ge=1)]] | None = Field(
        None, description="[low, high]: local steps drawn per round and client (heterogeneous local work)")
    batch_size: int = Field(32, ge=1, description="local mini-batch size")
    lr: float = Field(0.05, gt=0, description="local learning rate")
    momentum: float = Field(0.0, ge=0, lt=1, description="local SGD momentum")
    weight_decay: float = Field(0.0, ge=0, description="local L2 penalty (decoupled for adamw)")
    optimizer: Literal["sgd", "adam", "adamw"] = Field(
        "sgd", description="local optimiser: 'sgd' (momentum, L2 weight_decay), 'adam' (torch.optim.Adam: weight_decay is "
        "L2 added to the gradient), 'adamw' (torch.optim.AdamW: decoupled lr*weight_decay*p); Adam's moments start "
        "at zero every round for every client",
    )
    betas: tuple[Annotated[float, Field(ge=0, lt=1)], Annotated[float, Field(ge=0, lt=1)]] = Field(
        (0.9, 0.999), description="Adam's (beta1, beta2) for optimizer 'adam' / 'adamw'"
    )
    eps: float = Field(1e-8, gt=0, description="Adam's eps for optimizer 'adam' / 'adamw'")
    lr_schedule: Literal["constant", "poly", "step", "cosine"] = Field(
        "constant", description="'poly': lr (1 - s / (lr_horizon S))^lr_power at local step s of S in the round "
        "(a per-client polynomial schedule, FedDrive); across rounds r = 1..R (R = server.rounds): 'step': "
        "lr lr_gamma^floor((r - 1) / lr_step_rounds) (StepLR); 'cosine': lr_min + (lr - lr_min)(1 + cos(pi (r - 1) / R))/2 "
        "(CosineAnnealingLR, T_max = R)",
    )
    lr_gamma: float = Field(0.1, gt=0, description="'step' schedule: the factor every lr_step_rounds rounds")
    lr_step_rounds: int | None = Field(None, ge=1, description="'step' schedule: rounds between decays (required)")
    lr_min: float = Field(0.0, ge=0, description="'cosine' schedule: the rate it decays towards (eta_min)")
    lr_power: float = Field(0.9, gt=0, description="power of the poly schedule (FedDrive: 0.9)")
    lr_horizon: float = Field(1.0, ge=1, description="the poly schedule decays over lr_horizon x the round's local "
                              "steps (1: to 0 at the round's end; FedDrive's code: 10000, nearly constant)")
    temperature: float = Field(
        1.0, gt=0, description="softmax temperature tau: outputs / tau enter the loss (thesis eq. 3.2; 0.1 after Fed3R)"
    )
    freeze: list[Literal["backbone", "head", "norm"]] = Field(
        default_factory=list,
        description="parameter groups that do not train: FT(psi) = ['backbone'], FT(phi) = ['head']",
    )

    @model_validator(mode="after")
    def _epochs_or_steps(self) -> "TrainSection":
        given = [k for k in ("epochs", "steps", "steps_range") if getattr(self, k) is not None]
        if len(given) > 1:
            raise ValueError(f"set only one of train.epochs, train.steps, train.steps_range (got {', '.join(given)})")
        if self.steps_range is not None and self.steps_range[0] > self.steps_range[1]:
            raise ValueError(f"train.steps_range = {list(self.steps_range)}: low must not exceed high")
        if not given:
            object.__setattr__(self, "epochs", 1)
        if {"backbone", "head"} <= set(self.freeze):
            raise ValueError(f"freeze = {self.freeze} freezes every parameter; nothing would train")
        return self

    @model_validator(mode="after")
    def _optimizer_and_schedule(self) -> "TrainSection":
        if self.optimizer != "sgd" and self.momentum != 0:
            raise ValueError(f"train.momentum = {self.momentum} with train.optimizer = {self.optimizer!r}: Adam keeps its "
                             "own first moment (train.betas); set train.momentum = 0")
        if self.lr_schedule == "step" and self.lr_step_rounds is None:
            raise ValueError("train.lr_schedule = 'step' needs train.lr_step_rounds (rounds between decays, >= 1)")
        if self.lr_schedule == "cosine" and self.lr_min > self.lr:
            raise ValueError(f"train.lr_min = {self.lr_min} exceeds train.lr = {self.lr}: the cosine schedule decays "
                             "from lr to lr_min")
        return self


class EvalSection(Params):
    every: int = Field(1, ge=1, description="evaluate every k rounds (and always after the last)")
    last_rounds: int = Field(0, ge=0, description="FedDrive's avg_last_100: also evaluate every last_every rounds over "
                             "the final last_rounds rounds; summary.md gives their mean and std (0: off)")
    last_every: int = Field(5, ge=1, description="the evaluation interval inside the last_rounds window")
    batch_size: int = Field(512, ge=1, description="evaluation batch size (no effect on the numbers)")
    local: bool = Field(True, description="evaluate on every client's local test set (WMA, worst 10%)")
    initial: bool = Field(True, description="evaluate the initial model, before any training, as round 0 (every "
                          "curve starts at the model the run starts from)")
    oll: bool = Field(False, description="mask each client's local-test logits to its own training classes (OLL "
                      "with no fine-tuning, thesis Table 4.18's x column); test/* is unchanged")
    class_split: int = Field(0, ge=0, description="this many clients (drawn from the seed; all if more) evaluated on "
                             "the global test set: accuracy on their own classes vs the others (thesis Fig. 4.7)")
    select: Literal["last", "best"] = Field(
        "last", description='"last": the run\'s model is the last global model; "best": also keep the global model '
        "best on the validation set (select_metric) as RUN_DIR/best.safetensors (needs [validation])")
    select_metric: str | None = Field(
        None, description='select = "best": the validation metric to select by, "val/<metric>" (default: the task\'s '
        "primary metric on val)")

    @model_validator(mode="after")
    def _metric_only_with_best(self) -> "EvalSection":
        if self.select == "last" and self.select_metric is not None:
            raise ValueError(f"eval.select_metric = {self.select_metric!r} is set but eval.select = 'last' (no model is "
                             "selected); set eval.select = 'best' or remove eval.select_metric")
        return self


class PrivacySection(Params):
    """Where the randomness that protects a party comes from (``fedsight.secret``)."""

    noise: Literal["simulated", "secret"] = Field(
        "simulated", description='"simulated": DP noise and the watermark key derive from the run seed (reproducible '
        'research; anyone with the config can regenerate them, and run.json and summary.md say so); "secret": each '
        "party draws a secret from the OS CSPRNG and keeps it in its private state (client_state/secret); a Flower "
        "run is always secret")
    central_dp: CentralDPSection | None = Field(
        None, description="central DP (DP-FedAvg, server-side clipping, Gaussian noise, RDP/PLD accounting) on every "
        "path: fedsight.central_dp, docs/flower.md (central DP)")


#: the checkpoint layouts ``init.layout`` accepts: ``fedsight.weights.LAYOUTS``'s names (a test keeps them equal;
#: kept here so that validating a config does not import torch)
WEIGHT_LAYOUTS = ("fedsight", "torchvision", "timm", "vitpose", "pose_resnet", "basicsr", "edsr", "etc_rdsn", "kair",
                  "feddrive", "bisenet", "ladd")


class InitSection(Params):
    """Start the global model from a checkpoint instead of the seeded initialisation (``fedsight.weights``)."""

    weights: str | None = Field(None, description="checkpoint to start from: .safetensors, or .pth/.pt/.bin read "
                                "with torch.load(weights_only=True)")
    layout: Literal[WEIGHT_LAYOUTS] = Field(
        "fedsight", description="whose key names the checkpoint uses: fedsight (a run's model.safetensors), or the "
        "library or release that published it; which models each loads into: docs/weights.md")
    exclude: list[str] = Field(default_factory=list, description='FedSight keys left out, fnmatch patterns: '
                               '["head.*"] keeps the model\'s own classifier (another number of classes)')
    strict: bool = Field(True, description="require every model key not excluded; a checkpoint key the model does "
                         "not have is refused either way")

    @model_validator(mode="after")
    def _needs_weights(self) -> "InitSection":
        unused = [k for k in ("layout", "exclude", "strict") if self.weights is None
                  and getattr(self, k) != type(self).model_fields[k].get_default(call_default_factory=True)]
        if unused:
            raise ValueError(f"init.{unused[0]} is set but init.weights is not (it would do nothing); set init.weights "
                             f"or remove init.{unused[0]}")
        return self


STAGE_OVERRIDABLE = ("train", "server", "recipe")


class StageSection(BaseModel):
    """One stage of ``[[stages]]``: a name, its number of rounds, and override tables (``train``,
    ``server``, ``recipe``) deep-merged over the base config. The global model and per-client state
    carry over between stages; each stage's server optimizer starts fresh."""

    model_config = ConfigDict(extra="allow", frozen=True, strict=True)

    name: str = Field(..., min_length=1, pattern=r"^[A-Za-z0-9._+-]+$")
    rounds: int = Field(..., ge=1)

    @model_validator(mode="after")
    def _only_overridable(self) -> "StageSection":
        bad = sorted(set(self.model_extra or {}) - set(STAGE_OVERRIDABLE))
        if bad:
            raise ValueError(
                f"stage {self.name!r} overrides {', '.join(bad)}; a stage may override only {', '.join(STAGE_OVERRIDABLE)}"
            )
        if isinstance(server := (self.model_extra or {}).get("server"), dict) and "rounds" in server:
            raise ValueError(f"stage {self.name!r} sets server.rounds; a stage's length is its own rounds = {self.rounds}")
        return self


#: the most ``engine.threads`` a config may ask for (the machine's CPUs bound it again at run time)
MAX_THREADS = 1024


class EngineSection(Params):
    """Where and how the run computes (``fedsight.device``)."""

    device: str = Field("auto", description='"auto" (CUDA when available), "cpu", "cuda" or "cuda:N"')
    threads: int | Literal["auto"] = Field(
        "auto", description='torch intra-op threads; "auto" = 1 (small models: no thread-pool overhead or '
                            "oversubscription); at most 1024, and at run time at most the machine's CPUs (run.json "
                            "records the count used)"
    )
    deterministic: bool = Field(False, description="CUDA: deterministic kernels (bit-identical repeats on one GPU; slower)")
    heap_keep_mb: int = Field(
        256, ge=0, le=2047, description="CPU device: freed memory (MiB) the process keeps for the next step's tensors "
                                           "instead of returning it to the OS (glibc malloc; 0: its defaults)")
    vectorize: bool | Literal["auto"] = Field(
        "auto", description='train a round\'s clients together (torch.func.vmap): "auto" on CUDA where the recipe '
                            "allows it (one at a time on a CPU), true (any device; an error where the recipe does not "
                            "allow it), false (one client at a time)")
    max_clients_per_batch: int | None = Field(
        None, ge=1, description="vectorised training: at most this many clients at once (bounds memory); none = all")

    @field_validator("threads", mode="before")
    @classmethod
    def _threads(cls, value: Any) -> Any:
        if value != "auto" and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError("expected an integer >= 1 or \"auto\"")
        if value != "auto" and value > MAX_THREADS:  # a fixed cap: a config (and a run's config.json) is valid on any
            # machine; a run uses at most the machine's CPUs (fedsight.device.configure_threads)
            raise ValueError(f"at most {MAX_THREADS} (or \"auto\"); a run uses at most the machine's CPUs anyway")
        return value

    @field_validator("vectorize", mode="before")
    @classmethod
    def _vectorize(cls, value: Any) -> Any:
        if value not in ("auto", True, False) or isinstance(value, (int, float)) and not isinstance(value, bool):
            raise ValueError('expected true, false or "auto"')
        return value

    @field_validator("device")
    @classmethod
    def _device(cls, value: str) -> str:
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", value.strip()):
            raise ValueError('expected "auto", "cpu", "cuda" or "cuda:N"')
        return value.strip()


def _finite_speeds(sigma: float) -> float:
    """server.speed_sigma: client speeds exp(sigma * z), z ~ N(0, 1), and steps / speed must stay finite and
    nonzero in float64 (exp overflows past 709): sigma <= 20 does for any draw |z| < 35."""
    if sigma > SPEED_SIGMA_MAX:
        raise ValueError(f"at most {SPEED_SIGMA_MAX:g}: client speeds exp(sigma * z) must stay finite and nonzero "
                         f"(a larger spread overflows float64)")
    return sigma


#: the largest server.speed_sigma (see _finite_speeds)
SPEED_SIGMA_MAX = 20.0


def _unique_stage_names(stages: list[StageSection]) -> list[StageSection]:
    """stages: each stage's name is its own (``--set stages.NAME.key``, reports and checkpoints name stages)."""
    first: dict[str, int] = {}
    for i, st in enumerate(stages):
        if st.name in first:
            raise ValueError(f"stages[{first[st.name]}] and stages[{i}] are both named {st.name!r}; "
                             "each stage needs a name of its own")
        first[st.name] = i
    return stages
