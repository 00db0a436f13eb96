"""The main job's configuration: the flags built from TrainConfig, presets, the learning rate and
freeze each optimizer gets, and what --resume accepts. No training here."""
import argparse
import dataclasses

import pytest
import torch

import onebitlamb
from onebitlamb.train import compare, config, loop, pretrain
from onebitlamb.train.model import ModelConfig

PRETRAIN_FLAGS = {"--preset", "--optimizer", "--out", "--resume", "--overwrite", "--seed", "--steps", "--global-batch",
                  "--micro-batch", "--workers", "--lr", "--warmup-frac", "--weight-decay", "--clip", "--freeze",
                  "--var-freeze", "--var-update-scaler", "--local-step-scaler", "--warmup-dtype", "--compression-space",
                  "--bound-direction", "--no-bound-direction", "--trust-ratio-after-freeze", "--bucket-cap-mb", "--local-size", "--shard", "--agree-every",
                  "--eval-every", "--eval-samples", "--ckpt-every", "--corpus", "--stdlib-tests", "--cache-dir",
                  "--threads", "--progress", "--no-progress", "--stop-after-steps", "--timeout",
                  "--vocab-size", "--seq-len", "--hidden", "--layers", "--heads", "--intermediate"}


def _parser(module):
    parser = argparse.ArgumentParser(prog=f"onebitlamb {module.__name__.rsplit('.', 1)[1]}")
    module.add_arguments(parser)
    return parser


def _flags(parser):
    return {opt for action in parser._actions if "-h" not in action.option_strings
            for opt in action.option_strings}


def cfg(*flags, optimizer=None):
    args = _parser(pretrain).parse_args(["--preset", "tiny", "--out", "a", *flags])
    return config.config_from_args(args, optimizer=optimizer)


def test_pretrain_and_compare_have_the_same_flags_but_the_optimizers():
    pretrain_flags, compare_flags = _flags(_parser(pretrain)), _flags(_parser(compare))
    assert pretrain_flags == PRETRAIN_FLAGS
    assert compare_flags == PRETRAIN_FLAGS - {"--optimizer"} | {"--optimizers"}


def test_the_exchange_flags_reach_the_optimizer():
    def groups():  # torch.optim writes the defaults into the groups it is given
        return [{"params": [torch.nn.Parameter(torch.zeros(3))], "weight_decay": 0.0}]

    opt = loop.make_optimizer(cfg("--warmup-dtype", "bfloat16", "--bucket-cap-mb", "0.5"), groups())
    assert opt.defaults["warmup_dtype"] == "bfloat16" and opt.defaults["bucket_cap_mb"] == 0.5
    assert opt.exchange.overlap_with_backward and opt.exchange.warmup_dtype == torch.bfloat16
    lamb = loop.make_optimizer(cfg("--warmup-dtype", "bfloat16", optimizer="lamb"), groups())
    assert lamb.exchange.warmup_dtype == torch.float32  # the exact baseline stays float32
    space = loop.make_optimizer(cfg("--compression-space", "update", "--trust-ratio-after-freeze", "live"), groups())
    assert space.defaults["compression_space"] == "update" and space.defaults["trust_ratio_after_freeze"] == "live"
    assert space.defaults["bound_direction"] is True
    assert loop.make_optimizer(cfg("--no-bound-direction"), groups()).defaults["bound_direction"] is False
    assert loop.make_optimizer(cfg("--bound-direction"), groups()).defaults["bound_direction"] is True
    for bad in (["--warmup-dtype", "float16"], ["--bucket-cap-mb", "x"], ["--compression-space", "signs"]):
        with pytest.raises(SystemExit):
            cfg(*bad)


def test_shard_is_refused_where_hsdp_cannot_run_by_its_flag():
    for flags, said in ((["--shard", "0"], "--shard must be >= 1"),
                        (["--shard", "2", "--local-size", "2"], "--shard 2 cannot run with --local-size"),
                        (["--shard", "2", "--bucket-cap-mb", "1"], "--shard 2 cannot run with --bucket-cap-mb")):
        with pytest.raises(config.SetupError, match=said):
            cfg(*flags)
    with pytest.raises(config.SetupError, match="cannot run 0/1 Adam"):
        cfg("--shard", "2", optimizer="zerooneadam")
    with pytest.raises(config.SetupError, match="--shard 3 must divide the number of workers, 4"):
        cfg("--shard", "3").check(4)
    cfg("--shard", "2").check(4)  # 2 replicas of 2 shards


def test_every_flag_is_a_field_with_a_help_and_the_rest_are_preset_only():
    fields = {f.name: f for f in dataclasses.fields(config.TrainConfig)}
    dests = {a.dest for a in _parser(pretrain)._actions if a.option_strings and a.dest != "help"}
    assert dests == {name for name, f in fields.items() if "help" in f.metadata}
    for name in ("beta1", "eps", "mask_prob", "heldout_fraction", "dropout"):
        assert "help" not in fields[name].metadata
    for removed in ("--lr-lamb", "--lr-adam", "--auto-freeze", "--freeze-frac", "--freeze-window", "--unfreeze-rise",
                    "--compression-space", "--update-guard", "--beta2"):
        with pytest.raises(SystemExit):
            _parser(pretrain).parse_args(["--out", "a", removed, "1"])


def test_flags_override_the_preset_which_overrides_the_defaults():
    demo = config.config_from_args(_parser(pretrain).parse_args(["--out", "a"]))
    assert demo == config.TrainConfig(out="a") and demo.preset == "demo" and demo.steps == 512
    tiny = cfg()
    assert (tiny.steps, tiny.hidden, tiny.workers, tiny.seed) == (8, 32, 2, 1234)
    assert cfg("--steps", "20", "--seed", "7").steps == 20 and cfg("--seed", "7").seed == 7
    assert cfg().cache_dir == "a/cache" and cfg("--cache-dir", "c").cache_dir == "c"
    assert cfg().progress and not cfg("--no-progress").progress and cfg("--stdlib-tests").stdlib_tests
    assert cfg("--corpus", "x", "y").corpus == ["x", "y"]


def test_the_model_shape_flags_override_the_preset_and_reach_the_model():
    shape = cfg("--vocab-size", "600", "--seq-len", "16", "--hidden", "48", "--layers", "3", "--heads", "4",
                "--intermediate", "96")
    assert shape.model == ModelConfig(600, 16, 48, 3, 4, 96, 0.0)
    assert cfg().model == ModelConfig(512, 32, 32, 1, 2, 64, 0.0)  # tiny's own
    large = config.config_from_args(_parser(pretrain).parse_args(["--preset", "large", "--out", "a", "--layers", "2"]))
    assert (large.layers, large.hidden, large.heads) == (2, 256, 4)
    # a run resumed with another shape is refused, as with any setting that changes the numbers
    assert set(config.changed_settings(cfg("--hidden", "64"), dataclasses.asdict(cfg()))) == {"hidden"}


def test_presets():
    assert {"tiny", "demo", "b512", "b1024", "b4096", "large"} <= set(config.PRESETS)
    for name, (batch, steps, every) in {"b512": (512, 128, 16), "b1024": (1024, 400, 50),
                                        "b4096": (4096, 100, 20)}.items():
        c = config.config_from_args(_parser(pretrain).parse_args(["--preset", name, "--out", "a"]))
        assert (c.global_batch, c.steps, c.eval_every) == (batch, steps, every)
        assert dataclasses.replace(c, global_batch=256, steps=512, eval_every=32, preset="demo") == \
            config.TrainConfig(out="a")  # demo plus those three


def test_learning_rate_defaults_per_optimizer():
    assert cfg(optimizer="lamb").lr == cfg(optimizer="onebitlamb").lr == 2e-2
    assert cfg(optimizer="onebitadam").lr == 2e-3
    assert cfg("--lr", "1e-3", optimizer="onebitadam").lr == 1e-3
    large = config.config_from_args(_parser(pretrain).parse_args(["--preset", "large", "--out", "a"]),
                                    optimizer="onebitadam")
    assert large.lr == 2e-3  # no rates of its own


def test_freeze_auto_or_a_fraction():
    assert cfg().freeze == "auto" and cfg().freeze_step() == onebitlamb.AutoFreeze(total_steps=8)
    assert cfg("--steps", "60", "--freeze", "auto").freeze_step() == onebitlamb.AutoFreeze(total_steps=60)
    assert cfg("--steps", "60", "--freeze", "0.35").freeze_step() == 21
    assert cfg("--freeze", "1").freeze_step() == 8 and cfg("--freeze", "0.01").freeze_step() == 1


@pytest.mark.parametrize("bad", ["0", "1.5", "-0.2", "nan", "inf", "soon"])
def test_a_bad_freeze_is_refused_by_name(bad, capsys):
    with pytest.raises(SystemExit):
        cfg("--freeze", bad)
    err = capsys.readouterr().err
    assert "--freeze" in err and repr(bad) in err
    with pytest.raises(ValueError, match="freeze.*" + repr(bad)):
        config.TrainConfig(out="a", freeze=bad)


def test_zero_one_adam_takes_its_schedules_as_fractions_of_the_run():
    """--optimizer zerooneadam: var_freeze_step and local_step_scaler as fractions of --steps, the
    rest DeepSpeed's defaults; its learning rate that of 1-bit Adam."""
    from onebitlamb.train.loop import make_optimizer

    c = cfg("--steps", "40", optimizer="zerooneadam")
    assert (c.var_freeze, c.local_step_scaler, c.lr) == (0.25, 0.1, 2e-3)
    opt = make_optimizer(c, [torch.nn.Parameter(torch.zeros(4))])
    assert isinstance(opt, onebitlamb.ZeroOneAdam)
    assert {k: opt.defaults[k] for k in ("var_freeze_step", "local_step_scaler", "var_update_scaler",
                                         "local_step_clipper")} == {"var_freeze_step": 10, "local_step_scaler": 4,
                                                                    "var_update_scaler": 16, "local_step_clipper": 16}
    c = cfg("--steps", "40", "--var-freeze", "0.5", "--local-step-scaler", "1", "--var-update-scaler", "64",
            optimizer="zerooneadam")
    defaults = make_optimizer(c, [torch.nn.Parameter(torch.zeros(4))]).defaults
    assert (defaults["var_freeze_step"], defaults["var_update_scaler"]) == (20, 64)
    with pytest.raises(ValueError, match="--var-update-scaler must be >= 1, got 0"):
        cfg("--var-update-scaler", "0", optimizer="zerooneadam")
    # compare accepts it; its default stays the three optimizers of the demo's tables
    parser = _parser(compare)
    assert parser.parse_args(["--out", "a", "--optimizers", "lamb", "zerooneadam"]).optimizers == ["lamb", "zerooneadam"]
    assert parser.parse_args(["--out", "a"]).optimizers == ["lamb", "onebitlamb", "onebitadam"]


def test_the_warm_up_average_defaults_to_int8_for_1bit_lamb_where_it_can_run():
    """int8 where it held against float32 (1-bit LAMB); float32 for the others, and wherever the
    quantised average cannot run (buckets behind the backward, node groups), which a flag naming it
    is refused with."""
    assert cfg().warmup_dtype == "int8"
    assert cfg(optimizer="onebitadam").warmup_dtype == "float32"
    assert cfg(optimizer="zerooneadam").warmup_dtype == "float32"
    assert cfg(optimizer="lamb").warmup_dtype == "float32"
    assert cfg("--bucket-cap-mb", "1").warmup_dtype == "float32"
    assert cfg("--local-size", "2").warmup_dtype == "float32"
    assert cfg("--warmup-dtype", "bfloat16", "--local-size", "2").warmup_dtype == "bfloat16"
    assert cfg("--warmup-dtype", "float32").warmup_dtype == "float32"
    for flag, value in (("--bucket-cap-mb", "1"), ("--local-size", "2")):
        with pytest.raises(config.SetupError, match=f"--warmup-dtype int4 cannot run with {flag}"):
            cfg("--warmup-dtype", "int4", flag, value)
        with pytest.raises(config.SetupError, match=f"--warmup-dtype int8 cannot run with {flag}"):
            cfg("--warmup-dtype", "int8", flag, value, optimizer="onebitadam")
    # LAMB reads no --warmup-dtype (its average is always float32): nothing to refuse
    assert cfg("--warmup-dtype", "int8", "--local-size", "2", optimizer="lamb").local_size == 2
    # a run saved before the setting existed averaged in float32
    assert config.changed_settings(cfg("--warmup-dtype", "float32"), {
        k: v for k, v in dataclasses.asdict(cfg("--warmup-dtype", "float32")).items() if k != "warmup_dtype"}) == {}


@pytest.mark.parametrize("flag", ["--var-freeze", "--local-step-scaler"])
@pytest.mark.parametrize("bad", ["0", "1.5", "-0.2", "nan"])
def test_a_bad_zero_one_fraction_is_refused_by_name(flag, bad, capsys):
    with pytest.raises(SystemExit):
        cfg(flag, bad, optimizer="zerooneadam")
    err = capsys.readouterr().err
    assert flag in err and repr(bad) in err


def test_resume_refuses_every_changed_setting_but_the_output_and_display():
    def changed(saved_flags, now_flags, optimizer="onebitlamb"):
        saved = dataclasses.asdict(cfg(*saved_flags, optimizer=optimizer))
        return set(config.changed_settings(cfg(*now_flags, optimizer=optimizer), saved))

    assert changed([], ["--out", "b", "--cache-dir", "c", "--resume", "--stop-after-steps", "3", "--no-progress",
                        "--threads", "2"]) == set()
    assert changed(["--overwrite"], []) == set()
    assert changed(["--lr", "1e-2"], []) == {"lr"}
    assert changed(["--seed", "7"], ["--steps", "9"]) == {"seed", "steps"}
    assert changed(["--freeze", "0.35"], []) == {"freeze"}
    assert changed(["--freeze", "0.35"], [], optimizer="onebitadam") == {"freeze"}
    assert changed(["--freeze", "0.35"], [], optimizer="lamb") == set()  # LAMB never freezes
    assert changed([], [], optimizer="lamb") == set()
    assert changed(["--var-freeze", "0.5"], [], optimizer="zerooneadam") == {"var_freeze"}
    assert changed(["--local-step-scaler", "0.5"], [], optimizer="zerooneadam") == {"local_step_scaler"}
    assert changed(["--var-update-scaler", "8"], [], optimizer="zerooneadam") == {"var_update_scaler"}
    assert changed(["--var-update-scaler", "8"], [], optimizer="onebitadam") == set()
    assert changed(["--freeze", "0.35"], [], optimizer="zerooneadam") == set()  # read by the 1-bit optimizers only
    assert changed(["--var-freeze", "0.5"], [], optimizer="onebitlamb") == set()
    # LAMB's average is float32; 1-bit LAMB's, by default, int8
    assert set(config.changed_settings(cfg(), dataclasses.asdict(cfg(optimizer="lamb")))) == {"optimizer",
                                                                                              "warmup_dtype"}
    assert changed(["--no-bound-direction"], []) == {"bound_direction"}
    assert changed(["--no-bound-direction"], [], optimizer="zerooneadam") == {"bound_direction"}
    assert changed(["--no-bound-direction"], [], optimizer="lamb") == set()  # LAMB has no stage 2


# each optimizer-specific flag with a value other than its default
OPTIMIZER_FLAGS = {"warmup_dtype": "bfloat16", "compression_space": "momentum", "trust_ratio_after_freeze": "live",
                   "freeze": 0.35, "var_freeze": 0.5, "var_update_scaler": 8, "local_step_scaler": 0.5,
                   "bound_direction": False}


@pytest.mark.parametrize("optimizer", config.OPTIMIZERS)
def test_a_resume_refuses_a_flag_exactly_when_the_optimizer_reads_it(optimizer):
    """Whether an optimizer reads a flag is found by building it (the main job's make_optimizer)
    with and without the change; a resume with the flag changed is refused exactly then (a LAMB
    run resumed with another --warmup-dtype was refused, although LAMB never reads it)."""
    from onebitlamb.train.loop import make_optimizer

    assert set(config.READ_ONLY_BY) <= set(OPTIMIZER_FLAGS)

    def built(c):
        p = torch.nn.Parameter(torch.zeros(4))
        opt = make_optimizer(c, [{"params": [p], "weight_decay": 0.0}])
        return repr(sorted(opt.defaults.items())), repr(getattr(opt, "_phases", None)), \
            repr({k: v for k, v in vars(opt).items() if k.startswith("_") and isinstance(v, (int, float, str))})

    base = cfg(optimizer=optimizer)
    for flag, value in OPTIMIZER_FLAGS.items():
        other = dataclasses.replace(base, **{flag: value})
        reads = built(other) != built(base)
        refused = flag in config.changed_settings(other, dataclasses.asdict(base))
        assert refused == reads, (flag, "read" if reads else "not read", "refused" if refused else "accepted")


def test_agree_every_reaches_the_optimizer_and_a_resume_may_change_it():
    from onebitlamb.train.loop import make_optimizer

    def exchange_of(*flags):
        return make_optimizer(cfg(*flags), [{"params": [torch.nn.Parameter(torch.zeros(4))]}]).exchange
    assert exchange_of().agree_every == 1000
    assert exchange_of("--agree-every", "5").agree_every == 5
    assert exchange_of("--agree-every", "0").agree_every is None  # the first step only
    assert config.changed_settings(cfg("--agree-every", "5"), dataclasses.asdict(cfg())) == {}


@pytest.mark.parametrize("old,bound", [("adam", True), ("none", False), (None, False)])
def test_a_run_saved_under_the_old_name_or_before_the_bound_resumes_with_its_rule_only(old, bound):
    """A config saved with ``stage2_bound`` ("adam": bounded, "none": not), or before the bound
    existed (unbounded), resumes with its rule as ``bound_direction`` and is refused with the
    other, which would change its numbers; the refusal gives the flag that continues it."""
    saved = dataclasses.asdict(cfg())
    del saved["bound_direction"]
    if old is not None:
        saved["stage2_bound"] = old
    assert config.saved_settings(saved)["bound_direction"] is bound and "stage2_bound" not in config.saved_settings(saved)
    same, other = ("--bound-direction", "--no-bound-direction")[::1 if bound else -1]
    assert config.changed_settings(cfg(same), saved) == {}
    changed = config.changed_settings(cfg(other), saved)
    assert changed == {"bound_direction": (bound, not bound)}
    assert f"give the saved values ({same})" in config.resume_refusal(changed, "--resume")


BAD_VALUES = [
    ("--steps", "0", ">= 1"), ("--steps", "-3", ">= 1"), ("--global-batch", "0", ">= 1"),
    ("--micro-batch", "0", ">= 1"), ("--micro-batch", "-4", ">= 1"), ("--workers", "0", ">= 1"),
    ("--eval-every", "0", ">= 1"), ("--eval-samples", "0", ">= 1"), ("--ckpt-every", "-1", ">= 1"),
    ("--threads", "0", ">= 1"), ("--stop-after-steps", "-1", ">= 0"), ("--agree-every", "-1", ">= 0"),
    ("--warmup-frac", "1", r"in \[0, 1\)"), ("--warmup-frac", "1.5", r"in \[0, 1\)"),
    ("--warmup-frac", "-0.1", r"in \[0, 1\)"), ("--clip", "-1", ">= 0"), ("--weight-decay", "-0.01", ">= 0"),
    ("--lr", "-0.02", ">= 0"),
    ("--lr", "nan", "a finite number"), ("--lr", "inf", "a finite number"), ("--warmup-frac", "nan", "a finite number"),
    ("--clip", "inf", "a finite number"), ("--weight-decay", "inf", "a finite number"),
    ("--hidden", "0", ">= 1"), ("--layers", "0", ">= 1"), ("--intermediate", "-1", ">= 1"),
    ("--seq-len", "-1", ">= 1"), ("--seq-len", "7", ">= 8"), ("--vocab-size", "5", r"> 5 \(its special tokens\)"),
    ("--heads", "3", r"a divisor of --hidden \(32\)"),
]


@pytest.mark.parametrize("flag,value,rule", BAD_VALUES)
def test_a_bad_value_is_refused_at_the_start_by_flag_and_value(flag, value, rule, capsys):
    with pytest.raises(ValueError, match=f"^{flag} must be {rule}, got .*{value.lstrip('-')}"):
        cfg(flag, value)
    # the command line says so in one line, before anything starts
    from onebitlamb import cli

    for command in ("pretrain", "compare"):
        assert cli.main([command, "--preset", "tiny", "--out", "never-created", flag, value]) == 2
        err = capsys.readouterr().err
        assert f"onebitlamb {command}: error: {flag} must be" in err and value.lstrip("-") in err
        assert "Traceback" not in err


@pytest.mark.parametrize("name,value", [("mask_prob", 0.0), ("mask_prob", 1.5), ("heldout_fraction", 1.0),
                                        ("dropout", 1.0), ("beta1", 1.0), ("beta2", -0.1), ("eps", 0.0),
                                        ("eps", float("nan"))])
def test_a_bad_preset_setting_is_refused_by_name(name, value):
    with pytest.raises(ValueError, match=f"the preset setting {name} must be"):
        config.TrainConfig(out="a", **{name: value})


def test_every_preset_and_the_edges_are_accepted():
    for preset in config.PRESETS:
        config.config_from_args(_parser(pretrain).parse_args(["--preset", preset, "--out", "a"]))
    ok = cfg("--warmup-frac", "0", "--clip", "0", "--weight-decay", "0", "--stop-after-steps", "0", "--lr", "0")
    assert (ok.warmup_frac, ok.clip, ok.weight_decay, ok.stop_after_steps, ok.lr) == (0, 0, 0, 0, 0)
    assert cfg("--overwrite").overwrite and not cfg().overwrite


def test_resume_and_overwrite_together_are_refused():
    with pytest.raises(ValueError, match="--resume.*--overwrite.*one of them"):
        cfg("--resume", "--overwrite")
