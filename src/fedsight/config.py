"""Run configuration: TOML in, validated typed objects out.

Every section is a pydantic model that forbids unknown keys. Components (dataset, model, partitioner,
server optimizer, weighting, aggregator, sharing, recipe components) are written as a table with
``name`` plus that component's own parameters, or as a bare name string; the allowed parameters come
from the component's registered parameter model, so ``[model] name = "cnn"  widht = 3`` fails with one
line naming ``model.widht`` and the keys ``cnn`` accepts.

A config file may also describe a sweep: ``[sweep] seeds = [0, 1, 2]`` and any number of
``[[variants]]`` tables, each with a ``name`` and sections that are deep-merged over the base config.
"""

from __future__ import annotations

import copy
import re
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal, Union

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, create_model, field_validator, model_validator

from . import registry as R
from .errors import ConfigError
from .central_dp import CentralDPSection
from .config_messages import format_validation_error
from .registry import Params
from .rng import check_seed

__all__ = ["ConfigError", "parse_override", "read_toml", "set_path", "validate"]  # sweeps and loading: fedsight.sweep


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
    batch_size: int = Field(512, ge=1, description="evaluation batch size (no effect on the numbers)")
    local: bool = Field(True, description="evaluate on every client's local test set (WMA, worst 10%)")
    initial: bool = Field(True, description="evaluate the initial model, before any training, as round 0 (every "
                          "curve starts at the model the run starts from)")
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


class InitSection(Params):
    """Start the global model from a checkpoint instead of the seeded initialisation (``fedsight.weights``)."""

    weights: str | None = Field(None, description="checkpoint to start from: .safetensors, or .pth/.pt/.bin read "
                                "with torch.load(weights_only=True)")
    layout: Literal["fedsight", "torchvision", "timm"] = Field(
        "fedsight", description="whose key names the checkpoint uses: fedsight (a run's model.safetensors), "
        "torchvision (ResNets -> resnet*_imagenet, MobileNetV2 -> mobilenetv2 with cifar_stem = false) or timm "
        "(ViT-S/16, ViT-B/16 -> vit_s16, vit_b16)")
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


def _sections() -> dict[str, Any]:
    from .data.server_split import ValidationSection  # the server-held validation set (FedVG)
    from .pretrain import PretrainSection  # the server-held pre-training split (Fed3R's extractor)

    partition_extra = {
        "num_clients": (int, Field(..., ge=1, description="clients the training pool is split over")),
        "local_test_fraction": (float, Field(0.2, ge=0, lt=1, description="share of each client's examples kept "
                                                                                "as its local test set")),
    }
    recipe = create_model(
        "RecipeSection",
        __base__=Params,
        weighting=(spec_type(R.WEIGHTINGS), Field("data_size", validate_default=True,
                                                  description="how much each upload counts (fedsight list weightings)")),
        aggregator=(spec_type(R.AGGREGATORS), Field("mean", validate_default=True,
                                                    description="how uploads combine (fedsight list aggregators)")),
        sharing=(spec_type(R.SHARING), Field("global", validate_default=True,
                                             description="which tensors are global or personal (fedsight list sharing)")),
        components=(list[spec_type(R.COMPONENTS)], Field(
            default_factory=list, description="recipe parts, in order (fedsight list components)")),
    )
    server = create_model(
        "ServerSection",
        __base__=Params,
        rounds=(int, Field(..., ge=1, description="communication rounds")),
        clients_per_round=(int | None, Field(None, ge=1, description="clients sampled a round (default: all)")),
        fraction=(float | None, Field(None, gt=0, le=1, description="or: the share of clients sampled a round")),
        optimizer=(spec_type(R.SERVER_OPTIMIZERS), Field("sgd", validate_default=True, description=(
            "applied to the negative weighted delta: sgd (lr 1) = FedAvg; fedadam, fedyogi, ... (fedsight list "
            "optimizers)"))),
        # client failure (in-process; engine.loop.InProcessBackend.train documents the streams)
        min_clients=(int, Field(1, ge=1, description="fewer accepted updates: the round is not aggregated")),
        dropout=(float, Field(0.0, ge=0, lt=1, description="probability a sampled client drops out of a round")),
        speed_sigma=(Annotated[float, AfterValidator(_finite_speeds)],
                     Field(0.0, ge=0, description="stragglers: client speeds ~ LogNormal(0, sigma); at most 20")),
        deadline=(float | None, Field(None, gt=0, description="updates over this many unit-speed steps are lost")),
    )
    return {
        "plugins": (list[str], Field(default_factory=list, description="modules imported before validation, "
                                     "which register models, datasets or recipe parts by name")),
        "seed": (Annotated[int, AfterValidator(check_seed)], Field(0, ge=0)),
        "run": (RunSection, Field(default_factory=RunSection)),
        "task": (spec_type(R.TASKS), Field("classification", validate_default=True)),
        "data": (spec_type(R.DATASETS), ...),
        "partition": (spec_type(R.PARTITIONERS, partition_extra), ...),
        "model": (spec_type(R.MODELS), ...),
        "train": (TrainSection, Field(default_factory=TrainSection)),
        "server": (server, ...),
        "recipe": (recipe, Field(default_factory=recipe)),
        "eval": (EvalSection, Field(default_factory=EvalSection)),
        "engine": (EngineSection, Field(default_factory=EngineSection)),
        "privacy": (PrivacySection, Field(default_factory=PrivacySection)),
        "init": (InitSection, Field(default_factory=InitSection)),
        "stages": (Annotated[list[StageSection], AfterValidator(_unique_stage_names)], Field(default_factory=list)),
        "validation": (ValidationSection, Field(default_factory=ValidationSection)),
        "pretrain": (PretrainSection, Field(default_factory=PretrainSection)),
    }


def config_model() -> type[BaseModel]:
    """The Config model for the components registered now (rebuilt when registries change)."""
    from .plugins import load_builtin

    load_builtin()

    key = ("config", *(tuple(r.names()) for r in _ALL_REGISTRIES()))
    if key not in _SPEC_CACHE:
        cfg = create_model("Config", __base__=Params, **_sections())

        def _check(self: Any) -> Any:
            s = self.server
            if s.clients_per_round is not None and s.fraction is not None:
                raise ValueError("set either server.clients_per_round or server.fraction, not both")
            family = self.task.name
            for section, reg in (("data", R.DATASETS), ("model", R.MODELS)):
                entry = reg.get(getattr(self, section).name)
                if entry.task_family != family:
                    raise ValueError(
                        f"{section}.name = {entry.name!r} is a {entry.task_family} {reg.kind}, but task is {family!r}; "
                        f"{reg.kind}s for {family}: {', '.join(e.name for e in reg.entries() if e.task_family == family)}"
                    )
            v = self.validation
            if v.source == "dataset" and v.dataset is not None:  # V is a split of a dataset of this task
                entry = R.DATASETS.get(v.dataset["name"])
                if entry.task_family != family:
                    raise ValueError(
                        f"validation.dataset.name = {entry.name!r} is a {entry.task_family} dataset, but task is "
                        f"{family!r}; datasets for {family}: "
                        f"{', '.join(e.name for e in R.DATASETS.entries() if e.task_family == family)}")
            if self.stages and sum(st.rounds for st in self.stages) != s.rounds:
                raise ValueError(
                    f"server.rounds = {s.rounds} but the stages' rounds sum to {sum(st.rounds for st in self.stages)}"
                )
            if s.min_clients > (per := s.clients_per_round or self.partition.num_clients):
                raise ValueError(f"server.min_clients = {s.min_clients} exceeds the clients sampled per round ({per})")
            if s.clients_per_round is not None and s.clients_per_round > self.partition.num_clients:
                raise ValueError(
                    f"server.clients_per_round = {s.clients_per_round} exceeds partition.num_clients = {self.partition.num_clients}"
                )
            return self

        cfg = create_model("Config", __base__=cfg, __validators__={"_check": model_validator(mode="after")(_check)})
        _SPEC_CACHE[key] = cfg
    return _SPEC_CACHE[key]


def _ALL_REGISTRIES() -> list[R.Registry[Any]]:
    return [R.TASKS, R.MODELS, R.DATASETS, R.PARTITIONERS, R.WEIGHTINGS, R.SERVER_OPTIMIZERS, R.AGGREGATORS, R.COMPONENTS, R.SHARING]


# -- loading ---------------------------------------------------------------------------------------


def read_toml(path: str | Path) -> dict[str, Any]:
    """A TOML config, read by ``fedsight.safe_read.read_toml`` (a regular file of bounded size, strict UTF-8,
    nesting and digit limits): every failure is one ConfigError naming the file."""
    from .safe_read import read_toml as bounded

    return bounded(path)


def parse_override(text: str) -> tuple[list[str], Any]:
    """``a.b.c=value`` with a TOML value (``3``, ``0.1``, ``true``, ``"x"``, ``[1, 2]``); bare words
    are strings."""
    if "=" not in text:
        raise ConfigError(f"--set {text!r}: expected key=value")
    key, value = text.split("=", 1)
    key = key.strip()
    if not key or any(not p for p in key.split(".")):
        raise ConfigError(f"--set {text!r}: empty key")
    try:
        parsed = tomllib.loads(f"v = {value.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        parsed = value.strip()
    except ValueError as exc:  # an integer past Python's digit limit
        raise ConfigError(f"--set {key}: an integer of more than 4,300 digits") from None
    return key.split("."), parsed


def set_path(raw: dict[str, Any], path: list[str], value: Any) -> None:
    cur = raw
    for part in path[:-1]:
        nxt = cur.get(part)
        if isinstance(nxt, str):  # bare component name -> table
            nxt = {"name": nxt}
        if not isinstance(nxt, dict):
            nxt = {}
        cur[part] = nxt
        cur = nxt
    if path[-1] == "name" and path[:-1] != ["run"] and isinstance(cur.get("name"), str) and cur.get("name") != value:
        # switching component: drop the old component's parameters ([run] has a name but is no component)
        for k in list(cur):
            if k not in ("name", "num_clients", "local_test_fraction"):
                del cur[k]
    cur[path[-1]] = value


def deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for k, v in over.items():
        b = out.get(k)
        if isinstance(b, str) and isinstance(v, dict):
            b = {"name": b}
        if isinstance(b, dict) and isinstance(v, dict):
            if "name" in v and b.get("name") != v["name"] and k != "run":
                keep = {kk: vv for kk, vv in b.items() if kk in ("num_clients", "local_test_fraction")}
                out[k] = {**keep, **copy.deepcopy(v)}
            else:
                out[k] = deep_merge(b, v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def validate(raw: dict[str, Any], source: str = "config") -> BaseModel:
    """A validated config: every section's keys and values, then every recipe part's and option's
    requirements against what the task, the model and the config provide (``fedsight.capabilities``),
    then every stage as a config of its own. The modules ``raw["plugins"]`` names are imported first
    (``fedsight.plugins.load_plugins``): the names they register are valid in the rest of the config."""
    from .plugins import load_plugins

    load_plugins(raw.get("plugins", []), source)
    cls = config_model()
    try:
        cfg = cls.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, raw, cls, source)) from None
    from .model_selection import selection_problems

    problems = unmet_requirements(cfg) + part_problems(cfg) + model_problems(cfg) + selection_problems(cfg)
    if problems:
        raise ConfigError("\n".join(f"{source}: {p}" for p in problems))
    stage_configs(cfg, source)  # every stage must be a valid config too
    return cfg


def _parts(cfg: Any) -> list[tuple[str, R.Registry[Any], Any]]:
    """(config key, registry, spec) of every recipe part and the server optimizer."""
    rc = cfg.recipe
    parts = [("recipe.weighting", R.WEIGHTINGS, rc.weighting), ("recipe.aggregator", R.AGGREGATORS, rc.aggregator),
             ("recipe.sharing", R.SHARING, rc.sharing), ("server.optimizer", R.SERVER_OPTIMIZERS, cfg.server.optimizer)]
    return parts + [(f"recipe.components[{i}]", R.COMPONENTS, c) for i, c in enumerate(rc.components)]


def part_problems(cfg: Any) -> list[str]:
    """What each part's registered ``check(spec, cfg)`` finds wrong between its parameters and the rest of the
    config (e.g. Krum's ``byzantine`` against the clients a round samples): one line naming both keys."""
    out = []
    for where, reg, spec in _parts(cfg):
        check = reg.get(spec.name).meta.get("check")
        if check is not None and (why := check(spec, cfg)):
            out.append(f"{where}: {why}")
    return out


def model_problems(cfg: Any) -> list[str]:
    """Construction errors that depend on the model's parameters alone: group-norm group counts that do not
    divide a layer's channels. Found by building the model on the meta device (no memory, no data) for a
    placeholder input and output; any other construction error is left to the real build, which knows the
    data's shapes."""
    if getattr(cfg.model, "norm", None) != "group":
        return []
    import torch

    from .models import build_model
    from .models.layers import NormGroupsError
    from .tasks.base import component_params

    try:
        with torch.device("meta"):
            build_model(cfg.model.name, component_params(cfg.model), in_channels=3, num_outputs=2, image_size=32)
    except NormGroupsError as exc:
        return [f"model.group_norm_groups = {cfg.model.group_norm_groups}: {exc}"]
    except Exception:  # noqa: BLE001 - placeholder shapes; the real build reports its own errors
        pass
    return []


def requirements(cfg: Any) -> list[Any]:
    """What a validated config's recipe parts, sections and options need (``capabilities.Requirement``)."""
    from .capabilities import Requirement, resolve

    out = []
    for where, reg, spec in _parts(cfg):
        needs = resolve(reg.get(spec.name).requires, spec)
        if needs:
            out.append(Requirement(f"{where} = {spec.name!r}", needs))
    t = cfg.train
    if t.temperature != 1.0:
        out.append(Requirement(f"train.temperature = {t.temperature}", frozenset({"class_logits"})))
    if t.freeze:
        out.append(Requirement(f"train.freeze = {list(t.freeze)}", frozenset({"parameter_groups"})))
    v = cfg.validation
    if v.source != "none":
        out.append(Requirement(f"validation.source = {v.source!r}", frozenset({"server_split"})))
    if v.imbalance is not None:
        out.append(Requirement(f"validation.imbalance = {v.imbalance}", frozenset({"class_labels"})))
    if cfg.eval.select == "best":  # selection is on validation data, never on test
        out.append(Requirement("eval.select = 'best'", frozenset({"val_split"})))
    if cfg.pretrain.source != "none":
        out.append(Requirement(f"pretrain.source = {cfg.pretrain.source!r}",
                               frozenset({"server_split", "class_labels", "parameter_groups"})))
    return out


def provided(cfg: Any) -> tuple[dict[str, frozenset[str]], dict[str, str]]:
    """What the task, the model and the config sections of a validated config provide, and how to name
    each provider in a message."""
    from .capabilities import resolve

    task_spec = R.TASKS.get(cfg.task.name).meta["spec"](cfg.task)
    model = R.MODELS.get(cfg.model.name)
    config = {"val_split"} if cfg.validation.source != "none" else set()
    return (
        {"task": task_spec.provides, "model": resolve(model.provides, cfg.model), "config": frozenset(config)},
        {"task": f"task {cfg.task.name!r}", "model": f"model {cfg.model.name!r} (with these parameters)"},
    )


def unmet_requirements(cfg: Any) -> list[str]:
    """One line per requirement of ``cfg`` that its task, model or sections do not meet."""
    from .capabilities import missing

    have, names = provided(cfg)
    return missing(requirements(cfg), have, names)


def stage_configs(cfg: Any, source: str = "config") -> list[tuple[str, int, Any]]:
    """(name, rounds, validated config) of each ``[[stages]]`` entry: the base config with the
    stage's override tables deep-merged in and ``server.rounds`` set to the stage's rounds."""
    if not cfg.stages:
        return []
    base = cfg.model_dump(mode="json")
    base.pop("stages")
    out = []
    for i, st in enumerate(cfg.stages):
        raw = deep_merge(base, dict(st.model_extra or {}))
        raw["server"] = {**raw.get("server", {}), "rounds": st.rounds}
        out.append((st.name, st.rounds, validate(raw, f"{source} (stages[{i}] {st.name})")))
    return out
