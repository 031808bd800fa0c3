import pytest

from rlhfkit.config import ConfigError, SFTConfig, help_text, load_config, parse_overrides
from rlhfkit.config.fields import read_yaml


def test_yaml_and_dotted_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model: m\ndata: {train: t.jsonl}\ntrain: {lr: 1e-5, batch_size: 8}\n")
    cfg = load_config(SFTConfig, str(path), ["train.lr=5e-6", "lora.rank=16", "data.fields={prompt: q}"])
    assert cfg.train.lr == 5e-6 and isinstance(cfg.train.lr, float)
    assert cfg.train.batch_size == 8
    assert cfg.lora.rank == 16
    assert cfg.data.fields == {"prompt": "q"}


def test_yaml_float_without_dot_is_a_float(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("train: {lr: 1e-5}\n")
    assert read_yaml(path)["train"]["lr"] == 1e-5


@pytest.mark.parametrize("override, key", [
    ("train.lrr=1", "train.lrr"),
    ("bogus=1", "bogus"),
    ("lora.rank=abc", "lora.rank"),
    ("train.batch_size=2.5", "train.batch_size"),
    ("engine.backend=tpu", "engine.backend"),
    ("data.template=fancy", "data.template"),
])
def test_bad_keys_and_types_name_the_key(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(SFTConfig, None, ["model=m", "data.train=t", override])


def test_int_is_accepted_for_float_but_not_bool_for_int():
    cfg = load_config(SFTConfig, None, ["model=m", "data.train=t", "train.lr=1"])
    assert cfg.train.lr == 1.0
    with pytest.raises(ConfigError, match="train.epochs"):
        load_config(SFTConfig, None, ["model=m", "data.train=t", "train.epochs=true"])


def test_required_fields_and_validation():
    with pytest.raises(ConfigError, match="'model'"):
        load_config(SFTConfig, None, ["data.train=t"])
    with pytest.raises(ConfigError, match="micro_batch_size"):
        load_config(SFTConfig, None, ["model=m", "data.train=t", "train.batch_size=6", "train.micro_batch_size=4"])


@pytest.mark.parametrize("override, message", [
    ("lora.dropout=2", r"config key 'lora\.dropout': must be in \[0, 1\), got 2"),
    ("lora.rank=-3", r"config key 'lora\.rank': must be >= 0"),
    ("train.epochs=0", r"config key 'train\.epochs': 0 would train nothing"),
])
def test_values_out_of_range_name_the_key(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(SFTConfig, None, ["model=m", "data.train=t", override])


def test_values_in_range_pass():
    cfg = load_config(SFTConfig, None, ["model=m", "data.train=t", "lora.rank=8", "lora.dropout=0.1",
                                        "train.epochs=0", "train.max_steps=3"])  # max_steps set: epochs unused
    assert (cfg.lora.rank, cfg.lora.dropout, cfg.train.max_steps) == (8, 0.1, 3)
    with pytest.raises(ConfigError, match=r"lora\.alpha"):
        load_config(SFTConfig, None, ["model=m", "data.train=t", "lora.rank=8", "lora.alpha=-1"])


def test_override_syntax_error():
    with pytest.raises(ConfigError, match="dotted.key=value"):
        parse_overrides(["train.lr"])


def test_help_lists_every_field_with_doc_and_default():
    text = help_text(SFTConfig)
    for key in ("model", "output_dir", "data.train", "data.max_length", "train.lr", "train.micro_batch_size",
                "lora.rank", "lora.target_modules", "engine.backend", "engine.zero_stage", "load.trust_remote_code"):
        assert f"  {key}  (" in text
    assert "default 1e-05" in text and "peak learning rate" in text


def test_ppo_forward_batch_size_must_be_positive_or_null():
    from rlhfkit.config.ppo_schema import PPOSection

    PPOSection(forward_batch_size=None).validate("ppo.")
    PPOSection(forward_batch_size=64).validate("ppo.")
    with pytest.raises(ConfigError, match="ppo.forward_batch_size"):
        PPOSection(forward_batch_size=0).validate("ppo.")


def test_a_reward_kl_setting_that_grpo_and_rloo_would_ignore_is_an_error():
    from rlhfkit.config.ppo_schema import PPOSection

    group = {"n_samples_per_prompt": 4}
    with pytest.raises(ConfigError) as err:
        PPOSection(advantage_estimator="grpo", kl_coef=0.05, **group).validate("ppo.")
    assert str(err.value) == ("config key 'ppo.kl_coef': grpo puts the KL in the loss, not the reward, so "
                              "kl_coef=0.05 would not apply: set ppo.kl_loss_coef (e.g. 0.05) and ppo.kl_coef=0")
    with pytest.raises(ConfigError, match=r"^config key 'ppo.adaptive_kl': rloo puts the KL in the loss"):
        PPOSection(advantage_estimator="rloo", kl_coef=0.0, adaptive_kl=True, **group).validate("ppo.")
    # the default (untouched) and 0 pass; estimators that keep the KL in the reward take any coefficient
    PPOSection(advantage_estimator="grpo", **group).validate("ppo.")
    PPOSection(advantage_estimator="rloo", kl_coef=0.0, kl_loss_coef=0.05, **group).validate("ppo.")
    PPOSection(advantage_estimator="reinforce_pp_baseline", kl_coef=0.05, adaptive_kl=True, **group).validate("ppo.")


@pytest.mark.parametrize("override, message", [
    ({"score_clip": 0.0}, r"^config key 'ppo.score_clip': must be > 0 \(or null = off\), got 0$"),
    ({"score_clip": -5.0}, r"^config key 'ppo.score_clip': must be > 0"),
    ({"value_clip": -0.2}, r"^config key 'ppo.value_clip': must be > 0"),
    ({"log_ratio_clamp": 0.0}, r"^config key 'ppo.log_ratio_clamp'"),
    ({"kl_clamp": -1.0}, r"^config key 'ppo.kl_clamp'"),
    ({"entropy_coef": -0.01}, r"^config key 'ppo.entropy_coef': must be >= 0"),
    ({"lam": 1.5}, r"^config key 'ppo.lam': GAE's gamma and lam must be in \[0, 1\]"),
    ({"gamma": -0.1}, r"^config key 'ppo.gamma'"),
    ({"clip_eps": 1.0}, r"^config key 'ppo.clip_eps': must be < 1"),
    ({"adaptive_kl": True, "kl_coef": 0.0}, r"^config key 'ppo.kl_coef': adaptive KL .* needs a starting kl_coef > 0"),
])
def test_ppo_values_that_would_silently_do_something_else_are_refused(override, message):
    """score_clip 0 or below set every score to one value, a negative entropy_coef was ignored, an adaptive
    coefficient starting at 0 never moves: each is refused naming its key."""
    from rlhfkit.config.ppo_schema import PPOSection

    with pytest.raises(ConfigError, match=message):
        PPOSection(**override).validate("ppo.")
    PPOSection(score_clip=None, value_clip=None, log_ratio_clamp=20.0, kl_clamp=10.0, entropy_coef=0.0, lam=1.0,
               gamma=0.0, clip_eps=0.99, adaptive_kl=True, kl_coef=0.01).validate("ppo.")  # the limits pass


@pytest.mark.parametrize("override, message", [
    ("train.log_every=0", r"'train\.log_every': must be >= 1, got 0"),
    ("train.betas=[0.9]", r"'train\.betas': expected two numbers in \[0, 1\)"),
    ("train.betas=[2, 3]", r"'train\.betas': expected two numbers in \[0, 1\)"),
    ("train.min_lr_ratio=5", r"'train\.min_lr_ratio': must be in \[0, 1\]"),
    ("train.warmup_steps=-2", r"'train\.warmup_steps': must be >= 0"),
    ("train.weight_decay=-1", r"'train\.weight_decay': must be >= 0"),
    ("train.max_grad_norm=-1", r"'train\.max_grad_norm': must be >= 0 \(0 = off\)"),
    ("train.eval_every=-1", r"'train\.eval_every': must be >= 0 \(0 = only at the end\)"),
    ("train.save_every=-3", r"'train\.save_every': must be >= 0 \(0 = never\)"),
    ("train.keep_checkpoints=0", r"'train\.keep_checkpoints': must be >= 1"),
    ("data.eval_fraction=-0.5", r"'data\.eval_fraction': must be in \[0, 1\)"),
    ("data.eval_max_rows=-1", r"'data\.eval_max_rows': must be >= 0"),
    ("data.max_length=0", r"'data\.max_length': must be >= 2"),
])
def test_training_values_that_did_something_else_silently_are_refused(override, message):
    """Each of these ran before (a modulo by a negative, a clamp, an lr above its peak) or crashed mid-run."""
    with pytest.raises(ConfigError, match=f"^config key {message}"):
        load_config(SFTConfig, None, ["model=m", "data.train=t", override])


@pytest.mark.parametrize("override, message", [
    ("ppo.mini_batch_size=-2", r"'ppo\.mini_batch_size': must be >= 0"),
    ("data.max_prompt_length=0", r"'data\.max_prompt_length': must be >= 1"),
    ("gen.top_k=-3", r"'gen\.top_k': must be >= 0"),
    ("ppo.sample_every=-1", r"'ppo\.sample_every': must be >= 0"),
])
def test_ppo_sizes_out_of_range_are_refused(override, message):
    from rlhfkit.config.ppo_schema import PPOConfig

    with pytest.raises(ConfigError, match=f"^config key {message}"):
        load_config(PPOConfig, None, ["actor=a", "reward=r.py:f", "data.prompts=p", "train.max_steps=2",
                                      "train.micro_batch_size=2", "train.batch_size=4", override])


def test_settings_an_estimator_does_not_read_are_named():
    """GAE's gamma/lam, the value clip and advantage whitening mean nothing to GRPO; a changed one is named in the
    run's first log line rather than silently ignored (defaults are not listed)."""
    from rlhfkit.config.ppo_schema import PPOSection

    group = {"n_samples_per_prompt": 4, "kl_coef": 0.0}
    assert PPOSection(advantage_estimator="grpo", **group).without_effect() == []
    grpo = PPOSection(advantage_estimator="grpo", gamma=0.9, lam=0.5, whiten_advantages=False,
                      grpo_scale_by_std=False, **group)
    assert grpo.without_effect() == ["gamma=0.9", "lam=0.5", "whiten_advantages=False"]
    assert PPOSection(advantage_estimator="reinforce_pp_baseline", gamma=0.9, lam=0.5, **group).without_effect() == \
        ["lam=0.5"]  # REINFORCE++ discounts with gamma
    assert PPOSection(grpo_scale_by_std=False, lam=0.9).without_effect() == ["grpo_scale_by_std=False"]


@pytest.mark.parametrize("overrides, message", [
    (["engine.zero_stage=3"], r"'engine\.zero_stage': a DeepSpeed setting, and engine\.backend is local"),
    (["engine.deepspeed_config=/nonexistent.json"], r"'engine\.deepspeed_config': a DeepSpeed setting"),
    (["engine.offload_optimizer=true"], r"'engine\.offload_optimizer': a DeepSpeed setting"),
    (["engine.backend=deepspeed", "engine.offload_optimizer=true"],
     r"'engine\.offload_optimizer': optimizer offload needs ZeRO stage 1 or more"),
    (["engine.backend=deepspeed", "engine.precision=bf16"],
     r"'engine\.zero_stage': DeepSpeed's stage-0 bf16 optimizer accumulates gradients in bf16"),
    (["engine.backend=deepspeed", "engine.zero_stage=2", "engine.critic_zero_stage=0", "engine.precision=fp16"],
     r"'engine\.critic_zero_stage': DeepSpeed's stage-0 fp16 optimizer"),
])
def test_engine_settings_that_would_do_nothing_or_train_wrongly_are_refused(overrides, message):
    """DeepSpeed keys with the local engine were recorded in config.yaml and did nothing; offload at stage 0 was
    skipped silently; DeepSpeed's stage-0 half-precision optimizer starts with a step on zero gradients."""
    with pytest.raises(ConfigError, match=f"^config key {message}"):
        load_config(SFTConfig, None, ["model=m", "data.train=t", *overrides])
    load_config(SFTConfig, None, ["model=m", "data.train=t", "engine.backend=deepspeed", "engine.zero_stage=1",
                                  "engine.precision=bf16", "engine.offload_optimizer=true"])  # all fine at stage 1


@pytest.mark.parametrize("name", ["sft", "rm", "ppo", "ppo-opt-1.3b-1gpu", "ppo-7b-zero3-8gpu", "pipeline",
                                  "pipeline-llama"])
def test_every_shipped_config_passes_its_commands_checks(name):
    """configs/*.yaml are what users start from: each loads and validates as its command reads it."""
    from pathlib import Path

    from rlhfkit.commands.train import TRAIN_VERBS, _load

    verb = name.split("-")[0]
    path = Path(__file__).resolve().parents[2] / "configs" / f"{name}.yaml"
    load_config(_load(TRAIN_VERBS[verb][0]), str(path), [])


@pytest.mark.parametrize("verb", ["ppo", "dpo"])
def test_lora_dropout_under_disabled_dropout_is_refused_where_log_probs_are_compared(verb):
    """PPO and DPO compare a training forward's log-probs with a rollout's or the reference's: LoRA's dropout
    (applied by peft after the loaded model's dropout was switched off) made PPO's first update off-policy."""
    from rlhfkit.config.dpo_schema import DPOConfig
    from rlhfkit.config.ppo_schema import PPOConfig

    cls, base = {"ppo": (PPOConfig, ["actor=a", "reward=r.py:f", "data.prompts=p", "train.max_steps=2"]),
                 "dpo": (DPOConfig, ["model=m", "data.train=t.jsonl"])}[verb]
    with pytest.raises(ConfigError, match=r"'lora.dropout': 0.3 while load.disable_dropout is true"):
        load_config(cls, None, [*base, "lora.rank=8", "lora.dropout=0.3"])
    load_config(cls, None, [*base, "lora.rank=8", "lora.dropout=0.3", "load.disable_dropout=false"])  # dropout on
    load_config(SFTConfig, None, ["model=m", "data.train=t.jsonl", "lora.rank=8", "lora.dropout=0.3"])  # sft: fine


@pytest.mark.parametrize("key", ["batch_size", "micro_batch_size"])
def test_a_batch_size_below_one_names_its_own_key(key):
    with pytest.raises(ConfigError, match=rf"^config key 'train.{key}': must be >= 1, got 0$"):
        load_config(SFTConfig, None, ["model=m", "data.train=t.jsonl", f"train.{key}=0"])


def test_the_configs_and_the_algorithm_registry_import_without_torch():
    """The config reads its choices, --help and checks from rlhfkit.registry, which must stay light: `rlhfkit
    --help` and config validation must not import torch (the entries' functions import it when they run)."""
    import subprocess
    import sys

    code = ("import sys; import rlhfkit.config.ppo_schema, rlhfkit.config.dpo_schema, rlhfkit.registry.estimators, "
            "rlhfkit.registry.preference; from rlhfkit.config.fields import help_text; "
            "help_text(rlhfkit.config.ppo_schema.PPOConfig); help_text(rlhfkit.config.dpo_schema.DPOConfig); "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
