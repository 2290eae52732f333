"""`edgespec distill`: target data, then training, within one time budget; every phase resumable.

Owns the output folder:
    state.json          the run's settings and the seconds each phase has used (resumption reads it)
    log.txt             one line per event, appended across resumptions
    engine/             the target's quantized graph that makes the data (engine.py; the onnx engine only)
    data/chat/          target continuations of training prompts (shards, see data.py)
    data/corpus/        target top-k over local text, teacher-forced
    checkpoints/        training checkpoints (the newest one resumes training)
    config.json, model.safetensors, tokenizer files, edgespec_draft.json   the finished draft
"""
from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
from edgespec.distill import data, prompts
from edgespec.distill.data import DataConfig, feature_file
from edgespec.distill.draft_model import FEATURE_DESIGNS, TAPPED_DESIGNS
from edgespec.distill.eagle3_head import target_taps
from edgespec.distill.engine import DATA_QUANTS, OnnxTarget, engine_feature_width, engine_graph
from edgespec.distill.train import TrainConfig, train
from edgespec.exporters.drafts import DRAFT_INFO
from edgespec.exporters.sources import resolve_source
from edgespec.runtime.contract.errors import ExportError
from edgespec.runtime.pipeline import default_threads
from tqdm import tqdm

DATA_ENGINES = ("onnx", "torch")

# Shares of the time budget. Chat continuations are the draft's real workload, so they get the most;
# teacher forcing over local text is 7x cheaper per token and widens coverage. A feature design first
# runs the target once more over all that data for its features, which takes from training's share.
PHASE_SHARES = {"chat": 0.38, "corpus": 0.07, "features": 0.0, "train": 0.55}
FEATURE_PHASE_SHARES = {"chat": 0.38, "corpus": 0.07, "features": 0.13, "train": 0.42}


@dataclass(frozen=True)
class DistillConfig:
    target: str
    out: Path
    minutes: float = 60.0
    corpus: tuple[str, ...] = ()
    seed: int = 0
    design: str = "cut"
    threads: int | None = None
    resume: bool = False
    data_from: Path | None = None  # an earlier run's data folder: train on its shards instead of making new ones
    init: Path | None = None  # an earlier draft of the same design: training starts from its weights and head
    prompts: int = 6000
    # what answers the prompts and gives features: "onnx" (engine.py: the target's graph quantized as
    # `data_quant`, on onnxruntime's CPU provider) or "torch" (data.TorchTarget: transformers on `device`);
    # None: onnx on the CPU, torch on a GPU
    engine: str | None = None
    data_quant: str = "int4"
    device: str = "cpu"  # where torch runs: training, and the data with the torch engine
    cache_dir: Path = Path(".")
    data: DataConfig = DataConfig()
    training: TrainConfig = TrainConfig()

    def settings(self) -> dict:
        """What must match for a resumption to continue the same run."""
        return {"target": self.target, "minutes": self.minutes, "corpus": list(self.corpus), "seed": self.seed,
                "design": self.design, "prompts": self.prompts,
                "data_from": None if self.data_from is None else str(self.data_from),
                "init": None if self.init is None else str(self.init),
                "drafting_steps": self.training.drafting_steps, "lr": self.training.lr,
                "engine": self.data_engine, "data_quant": self.data_quant if self.data_engine == "onnx" else None}

    @property
    def data_engine(self) -> str:
        return self.engine or ("onnx" if self.device == "cpu" else "torch")

    @property
    def shares(self) -> dict[str, float]:
        """Each phase's share of --minutes; with reused data the whole budget goes to features and training."""
        shares = FEATURE_PHASE_SHARES if self.design in FEATURE_DESIGNS else PHASE_SHARES
        if self.data_from is None:
            return shares
        rest = shares["features"] + shares["train"]
        return {"chat": 0.0, "corpus": 0.0, "features": shares["features"] / rest, "train": shares["train"] / rest}


@dataclass
class RunState:
    settings: dict
    used_s: dict = field(default_factory=lambda: {name: 0.0 for name in PHASE_SHARES})
    finished: bool = False


class RunLog:
    def __init__(self, path: Path):
        self.path = path

    def __call__(self, message: str) -> None:
        line = f"{time.strftime('%Y-%m-%d %H:%M:%S')} {message}"
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(line + "\n")
        print(f"edgespec distill: {message}", flush=True)


def _open_state(config: DistillConfig) -> RunState:
    path = config.out / "state.json"
    if path.is_file():
        saved = json.loads(path.read_text())
        if not config.resume:
            raise ExportError(f"{config.out} already holds a distill run; pass --resume to continue it "
                              "or choose another --out")
        saved["settings"] = _with_engine(saved["settings"])
        if saved["settings"] != config.settings():
            changed = sorted(k for k in config.settings() if saved["settings"].get(k) != config.settings()[k])
            raise ExportError(f"cannot resume {config.out}: it was started with different settings ({', '.join(changed)})")
        state = RunState(**saved)
        state.used_s = {name: state.used_s.get(name, 0.0) for name in PHASE_SHARES}  # runs from before a phase existed
        return state
    if config.out.exists() and any(config.out.iterdir()):
        raise ExportError(f"{config.out} exists and is not a distill run folder; choose an empty or new --out")
    config.out.mkdir(parents=True, exist_ok=True)
    return RunState(settings=config.settings())


def _with_engine(settings: dict) -> dict:
    """A run's saved settings; a run from before the onnx engine made its data with torch."""
    return {"engine": "torch", "data_quant": None, **settings}


def features_made_alike(config: DistillConfig) -> Path | None:
    """The features folder of the run that owns `config.data_from`, when that run made them for the same
    target with the same engine and quantization: a second round on its data (`--data`) reuses them."""
    if config.data_from is None:
        return None
    source, state = config.data_from / "features", config.data_from.parent / "state.json"
    if not source.is_dir() or not state.is_file():
        return None
    try:
        made_by = _with_engine(json.loads(state.read_text())["settings"])
    except (OSError, json.JSONDecodeError, KeyError, TypeError):
        return None  # not a distill run's state: make the features anew
    mine = config.settings()
    same = all(made_by.get(key) == mine[key] for key in ("target", "engine", "data_quant"))
    # an eagle3 head reads three layers' streams, the other feature designs the final hidden state
    same = same and (made_by.get("design") in TAPPED_DESIGNS) == (config.design in TAPPED_DESIGNS)
    return source if same else None


def _save_state(config: DistillConfig, state: RunState) -> None:
    partial = config.out / "state.json.partial"
    partial.write_text(json.dumps(asdict(state), indent=1))
    partial.replace(config.out / "state.json")


def _phase(config: DistillConfig, state: RunState, name: str, log: RunLog, work) -> None:
    """Runs `work(deadline)` with what is left of the phase's share, and books the time it used."""
    if not config.shares[name]:
        return
    left = config.shares[name] * config.minutes * 60 - state.used_s[name]
    if left <= 0:
        log(f"{name}: time share used up, skipped")
        return
    started = time.time()
    try:
        work(started + left)
    finally:
        state.used_s[name] += time.time() - started
        _save_state(config, state)


def distill(config: DistillConfig) -> Path:
    corpus = _checked_corpus(config)
    state = _open_state(config)
    log = RunLog(config.out / "log.txt")
    if state.finished:
        log("already finished; nothing to do")
        return config.out
    if config.threads:
        torch.set_num_threads(config.threads)
    config = replace(config, training=replace(config.training, device=config.device))
    torch.manual_seed(config.seed)
    source = resolve_source(config.target, config.cache_dir)
    model, tokenizer = source.load()
    if config.design in TAPPED_DESIGNS:
        target_taps(model.config)  # a target too shallow for the design is refused before any data
    log(f"target {source.description}; budget {config.minutes:g} min; used so far {state.used_s}")
    phases = Phases(config, model, tokenizer, corpus, log)
    if config.data_from is not None:  # its chat and corpus shares are zero: those phases do not run
        log(f"data: reusing the target data in {phases.data_dir}")
    _phase(config, state, "chat", log, phases.chat)
    _phase(config, state, "corpus", log, phases.teacher_forced)
    _phase(config, state, "features", log, phases.features)
    _phase(config, state, "train", log, phases.training)
    state.finished = True
    _save_state(config, state)
    log(f"draft written to {config.out}")
    return config.out


def _checked_corpus(config: DistillConfig) -> list[Path]:
    """The corpus paths, after every check that can fail before minutes of work."""
    if config.minutes <= 0:
        raise ExportError(f"--minutes must be positive, got {config.minutes}")
    if config.data_engine not in DATA_ENGINES:
        raise ExportError(f"--data-engine takes {' or '.join(DATA_ENGINES)} (got {config.data_engine!r})")
    if config.data_quant not in DATA_QUANTS:
        raise ExportError(f"--data-quant takes {', '.join(DATA_QUANTS)} (got {config.data_quant!r})")
    if config.data.batch < 1:
        raise ExportError(f"--slots must be at least 1 (got {config.data.batch})")
    if config.prompts < 1:
        raise ExportError(f"--prompts must be at least 1 (got {config.prompts})")
    if config.training.batch < 1:
        raise ExportError(f"--train-batch must be at least 1 (got {config.training.batch})")
    if config.device not in ("cpu", "cuda"):
        raise ExportError(f"--device takes cpu or cuda (got {config.device!r})")
    if config.device == "cuda" and not torch.cuda.is_available():
        raise ExportError("--device cuda: this torch sees no CUDA GPU (torch.cuda.is_available() is False)")
    corpus = [Path(p) for p in config.corpus] or prompts.default_corpus()
    missing = [str(p) for p in corpus if not p.exists()]
    if missing:
        raise ExportError(f"corpus paths not found: {', '.join(missing)}")
    if config.init is not None:
        if not (config.init / DRAFT_INFO).is_file():
            raise ExportError(f"{config.init} is not a draft that edgespec distill wrote (no {DRAFT_INFO})")
        trained_as = json.loads((config.init / DRAFT_INFO).read_text()).get("training", {}).get("design")
        if trained_as != config.design:
            raise ExportError(f"{config.init} holds a {trained_as} draft; it cannot start a {config.design} one")
    if config.training.drafting_steps > 1 and config.design not in FEATURE_DESIGNS:
        raise ExportError(f"--drafting-steps is for drafts that read the target's features (eagle, eagle3); "
                          f"the {config.design} design drafts every step alike")
    if config.data_from is not None and not data.shard_paths(config.data_from / "chat"):
        raise ExportError(f"{config.data_from} holds no target data: give the `data` folder of an earlier distill run")
    return corpus


class Phases:
    """The run's phases, each given the time it may take: target answers to prompts, the target over
    local text, the target's features, training."""

    def __init__(self, config: DistillConfig, model, tokenizer, corpus: list[Path], log):
        self.config, self.model, self.tokenizer, self.corpus, self.log = config, model, tokenizer, corpus, log
        self.data_dir = config.out / "data" if config.data_from is None else config.data_from
        self.features_dir = config.out / "data" / "features"
        self._target = None

    @property
    def target(self):
        """What makes the data (see DistillConfig.engine), built on first use: a phase that does not run
        needs none."""
        if self._target is None:
            config = self.config
            if config.data_engine == "torch":
                pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
                self._target = data.TorchTarget(self.model, config.device, config.data.batch, int(pad), self.taps)
            else:
                graph, facts = self._engine_graph()
                self._target = OnnxTarget(graph, facts, config.data.batch, config.threads or default_threads(),
                                          engine_feature_width(graph))
        return self._target

    def _engine_graph(self):
        """The quantized graph, written once per run (a resumed run reuses it)."""
        folder = self.config.out / "engine"
        context = min(getattr(self.model.config, "max_position_embeddings", None) or 8192, 8192)
        self.log(f"engine: the target's {self.config.data_quant} graph for the data in {folder}")
        return engine_graph(self.model, folder, self.config.data_quant, context, self.taps)

    @property
    def taps(self):
        """The target layers the design reads (exporters/eagle3.py: FeatureTaps); None: its final hidden state."""
        return target_taps(self.model.config) if self.config.design in TAPPED_DESIGNS else None

    def all_shards(self) -> list[Path]:
        """The held-out shard first: training cannot measure itself without it."""
        chat_shards = data.shard_paths(self.data_dir / "chat")
        return chat_shards[-1:] + chat_shards[:-1] + data.shard_paths(self.data_dir / "corpus")

    def chat(self, deadline: float) -> None:
        texts = prompts.training_prompts(self.config.prompts, self.config.seed, self.corpus)
        with tqdm(desc="target continuations", unit="tok") as bar:
            written = data.generate_shards(self.target, self.tokenizer, texts, self.data_dir / "chat", self.config.data,
                                           deadline, progress=bar.update)
        self.log(f"chat: {written} new shards, {len(data.shard_paths(self.data_dir / 'chat'))} in all")

    def teacher_forced(self, deadline: float) -> None:
        files = prompts.python_files(self.corpus)
        # in file order from a seeded shuffle: a longer phase takes more of the same sequence
        windows = data.corpus_windows(self.tokenizer, files, window=256, limit=4000, seed=self.config.seed)
        with tqdm(desc="target over local text", unit="tok") as bar:
            written = data.teacher_forced_shards(self.target, windows, self.data_dir / "corpus", self.config.data,
                                                 deadline, progress=bar.update)
        self.log(f"corpus: {written} new shards")

    def features(self, deadline: float) -> None:
        earlier = features_made_alike(self.config)
        if earlier is not None:
            reused = data.link_features(earlier, self.all_shards(), self.features_dir)
            self.log(f"features: {reused} reused from {earlier} (the same target, engine and quantization)")
        with tqdm(desc="target features", unit="tok") as bar:
            written = data.feature_shards(self.target, self.all_shards(), self.features_dir, deadline,
                                          progress=bar.update)
        self.log(f"features: {written} new feature files")

    def training(self, deadline: float) -> None:
        config = self.config
        chat_shards = data.shard_paths(self.data_dir / "chat")
        if len(chat_shards) < 2:
            raise ExportError("too little training data was produced (two shards of target answers at least): "
                              "give the run more --minutes")
        shards = chat_shards[:-1] + data.shard_paths(self.data_dir / "corpus")
        if config.design in FEATURE_DESIGNS:  # shards the features phase did not reach are left out
            if not feature_file(self.features_dir, chat_shards[-1]).is_file():
                raise ExportError("the features phase did not reach the held-out shard: give the run more --minutes")
            shards = [s for s in shards if feature_file(self.features_dir, s).is_file()]
            if not shards:  # a short run's features may cover the held-out shard alone (history.md §66)
                raise ExportError("the features phase reached only the held-out shard, so there is nothing to "
                                  "train on: give the run more --minutes")
        # the last shard of target answers is held out: agreement is measured where the draft will work
        train(self.model, self.tokenizer, shards, chat_shards[-1:], config.out,
              replace(config.training, design=config.design, seed=config.seed), deadline, self.log,
              self.features_dir, init=config.init)
