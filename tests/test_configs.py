"""Every shipped YAML config parses, prints a complete config that round-trips, and builds its Trainer, model and
data on CPU (the GPU ones with ``--trainer.accelerator cpu``; nothing is trained here except the HF fine-tune config,
which trains 2 steps on a tiny HF model from the pretrained weights). The tiny CPU config trains in test_cli.py."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import numpy as np
import pytest
import transformers
import yaml

from lightning_megatron import MegatronLMFromHF, MegatronStrategy
from lightning_megatron.cli import build_cli
from lightning_megatron.data.tokens import write_token_file
from tests.hf_dense_models import hf_forward, make_hf_model

CONFIGS = sorted((Path(__file__).parent.parent / "examples" / "configs").glob("*.yaml"))


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_hf_model("llama", tmp_path_factory.mktemp("hf") / "llama")


def _print_config(args: list[str], capsys: pytest.CaptureFixture) -> str:
    with pytest.raises(SystemExit) as exited:
        build_cli(["fit", *args, "--print_config"])
    assert exited.value.code in (0, None)
    return capsys.readouterr().out


@pytest.mark.parametrize(
    ("flag", "name", "documented"),
    [
        ("--trainer.strategy.help", "MegatronStrategy", "virtual-pipeline chunks per pipeline rank"),
        ("--data.help", "lightning_megatron.TokenFileDataModule", "tail fraction of the windows held out"),
        ("--model.help", "MegatronLMFromHF", "a local HF model directory"),
    ],
)
def test_help_documents_each_argument(flag: str, name: str, documented: str, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        build_cli(["fit", flag, name])
    assert documented in " ".join(capsys.readouterr().out.split())


def test_all_configs_are_here() -> None:
    names = {path.name for path in CONFIGS}
    assert {"tiny_cpu.yaml", "llama_1b_gpu.yaml", "llama_1b_tp2.yaml", "llama_1b_pp2.yaml", "hf_finetune.yaml"} <= names


@pytest.mark.parametrize("config", CONFIGS, ids=[path.stem for path in CONFIGS])
def test_config_prints_round_trips_and_builds(
    config: Path, hf_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.chdir(tmp_path)  # the configs' relative log/checkpoint dirs
    raw = yaml.safe_load(config.read_text())
    overrides = ["--trainer.accelerator", "cpu"]
    if raw["model"]["class_path"].endswith("MegatronLMFromHF"):
        overrides += ["--model.init_args.hf_path", str(hf_model)]
    printed = _print_config(["--config", str(config), *overrides], capsys)
    assert "init_args:" in printed
    assert "hidden_dropout:" in printed or "hf_path:" in printed  # the complete model arguments, defaults included
    Path("printed.yaml").write_text(printed)
    assert _print_config(["--config", "printed.yaml"], capsys) == printed

    # The printed config builds (without fit's own arguments); building starts no process.
    fit_only = ("ckpt_path", "weights_only")
    Path("build.yaml").write_text(
        yaml.safe_dump({k: v for k, v in yaml.safe_load(printed).items() if k not in fit_only})
    )
    cli = build_cli(["--config", "build.yaml"], run=False)
    strategy = cli.trainer.strategy
    assert isinstance(strategy, MegatronStrategy)
    want = raw["trainer"]["strategy"]["init_args"]
    for key in ("tp", "pp", "vpp", "micro_batch_size"):
        assert getattr(strategy.parallel, key, getattr(strategy, key, None)) == want.get(
            key, 1 if key != "vpp" else None
        )
    assert cli.trainer.world_size == raw["trainer"]["devices"]
    assert cli.trainer.precision == raw["trainer"].get("precision", "32-true")
    cli.model.config.validate_parallel(strategy.parallel)
    assert cli.datamodule.seq_length == cli.model.config.seq_length
    assert cli.datamodule.batch_size % strategy.micro_batch_size == 0


def test_hf_finetune_config_trains_from_the_pretrained_weights(
    hf_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The config as shipped (its ModelCheckpoint and SaveHF callbacks included), shrunk to 2 steps on CPU."""
    monkeypatch.chdir(tmp_path)
    vocab = transformers.AutoConfig.from_pretrained(hf_model).vocab_size
    write_token_file([np.random.default_rng(0).integers(0, vocab, 40 * 16)], "sft.bin", "uint32")
    config = next(path for path in CONFIGS if path.name == "hf_finetune.yaml")
    cli = build_cli(
        ["--config", str(config), "--trainer.accelerator", "cpu", "--trainer.precision", "32-true",
         "--trainer.max_steps", "2", "--trainer.val_check_interval", "2", "--trainer.limit_val_batches", "1",
         "--trainer.enable_progress_bar", "false", "--model.init_args.hf_path", str(hf_model),
         "--model.init_args.seq_length", "16", "--model.init_args.lr", "0.01", "--model.init_args.warmup_steps", "0",
         "--data.init_args.path", "sft.bin", "--data.init_args.seq_length",
         "16", "--data.init_args.batch_size", "4", "--data.init_args.val_fraction", "0.2",
         "--data.init_args.shuffle", "false"],
        run=False,
    )  # fmt: skip
    assert isinstance(cli.model, MegatronLMFromHF)
    losses: list[float] = []

    class Record(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
            losses.append(float(outputs["loss"]))

    cli.trainer.callbacks.append(Record())
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    # The first step's loss is transformers' loss of the same batch: the weights came from the checkpoint.
    first_batch = next(iter(cli.datamodule.train_dataloader()))
    assert losses[0] == pytest.approx(hf_forward(hf_model, first_batch)[1], rel=1e-5)
    assert losses[1] != losses[0]
    # SaveHF wrote the trained weights: transformers' loss on the validation batch is the logged val_loss.
    val_batch = next(iter(cli.datamodule.val_dataloader()))
    val_loss = float(cli.trainer.callback_metrics["val_loss"])
    assert hf_forward(tmp_path / "out" / "hf_finetune", val_batch)[1] == pytest.approx(val_loss, rel=1e-5)
    assert hf_forward(hf_model, val_batch)[1] != pytest.approx(val_loss, rel=1e-5)
    assert list((tmp_path / "checkpoints" / "hf_finetune").glob("*.ckpt"))  # ModelCheckpoint(monitor="val_loss")


def test_llama_1b_config_shrunk_trains_with_its_logger_and_callbacks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The 1B config's Trainer, logger and callbacks as shipped, with a tiny model on CPU for 2 steps."""
    monkeypatch.chdir(tmp_path)
    Path("data").mkdir()
    write_token_file([np.random.default_rng(0).integers(0, 32000, 3300 * 32)], "data/tokens.bin")  # 16 val windows
    config = next(path for path in CONFIGS if path.name == "llama_1b_gpu.yaml")
    tiny = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "ffn_hidden_size": 128, "seq_length": 32}
    cli = build_cli(
        ["--config", str(config), "--trainer.accelerator", "cpu", "--trainer.precision", "32-true",
         "--trainer.max_steps", "2", "--trainer.val_check_interval", "2", "--trainer.limit_val_batches", "1",
         "--trainer.log_every_n_steps", "1", "--trainer.enable_progress_bar", "false",
         *[arg for key, value in tiny.items() for arg in (f"--model.init_args.config.{key}", str(value))],
         "--data.init_args.seq_length", "32", "--data.init_args.num_workers", "0"],
        run=False,
    )  # fmt: skip
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    assert cli.trainer.global_step == 2
    events = list((tmp_path / "logs" / "llama_1b").glob("version_0/events.out.tfevents.*"))
    assert len(events) == 1
    assert {"train_loss", "lr", "tokens_per_s", "val_loss", "val_ppl"} <= set(cli.trainer.callback_metrics)
