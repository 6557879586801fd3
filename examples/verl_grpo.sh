#!/usr/bin/env bash
# GRPO on GSM8K-style data with verl 0.9.1 on rlk: verl's FSDP2 actor computes its
# log-probabilities with rlk (VERL_ENGINE_VENDOR=rlk), vLLM's rollout runs rlk's model class, and
# verl's training/rollout_probs_diff_max is the number to watch (rlk's CPU tests hold it at 0).
#
# NOT RUN HERE: written for one node of 8 GPUs with verl 0.9.1 and vllm 0.32.0 installed; the
# project's CI runs the engine, the GRPO pieces, verl's vLLM server and weight sync and these
# overrides on CPU only (packages/rlk-integrations/tests/test_verl.py, test_verl_rollout.py).
# Nothing below has been measured.
#
# Install (verl's own metadata pins an older transformers and vLLM, so verl goes in without its
# dependencies; rlk-integrations[verl] names its runtime needs):
#   pip install "rlk-integrations[verl]" vllm==0.32.0 && pip install --no-deps verl==0.9.1
# Data: examples/data_preprocess/gsm8k.py of verl's repository writes the parquet files below:
#   python examples/data_preprocess/gsm8k.py --local_save_dir "$HOME/data/gsm8k"
set -euo pipefail

MODEL=${MODEL:-Qwen/Qwen2.5-0.5B-Instruct}
DATA=${DATA:-$HOME/data/gsm8k}

# The Hydra lines rlk needs (the plugin as external_lib, FSDP2, packed rows, rlk's fused
# log-prob contract, vLLM on rlk's model class reporting the tempered log-probs); one per line.
mapfile -t RLK_OVERRIDES < <(python -c \
    "import rlk_integrations.adapters.verl as v; print('\n'.join(v.overrides('Qwen2ForCausalLM')))")

VERL_ENGINE_VENDOR=rlk python -m verl.trainer.main_ppo \
    algorithm.adv_estimator=grpo \
    algorithm.use_kl_in_reward=False \
    data.train_files="$DATA/train.parquet" \
    data.val_files="$DATA/test.parquet" \
    data.train_batch_size=256 \
    data.max_prompt_length=512 \
    data.max_response_length=1024 \
    data.filter_overlong_prompts=True \
    data.truncation=error \
    actor_rollout_ref.model.path="$MODEL" \
    actor_rollout_ref.model.enable_gradient_checkpointing=True \
    actor_rollout_ref.actor.optim.lr=1e-6 \
    actor_rollout_ref.actor.ppo_mini_batch_size=64 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8 \
    actor_rollout_ref.actor.use_kl_loss=True \
    actor_rollout_ref.actor.kl_loss_coef=0.001 \
    actor_rollout_ref.actor.kl_loss_type=low_var_kl \
    actor_rollout_ref.actor.entropy_coeff=0 \
    actor_rollout_ref.actor.fsdp_config.param_offload=False \
    actor_rollout_ref.actor.fsdp_config.optimizer_offload=False \
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=16 \
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16 \
    actor_rollout_ref.rollout.gpu_memory_utilization=0.6 \
    actor_rollout_ref.rollout.n=5 \
    actor_rollout_ref.rollout.temperature=1.0 \
    "${RLK_OVERRIDES[@]}" \
    trainer.critic_warmup=0 \
    trainer.logger='["console"]' \
    trainer.project_name=rlk_verl \
    trainer.experiment_name=qwen2.5-0.5b-gsm8k-grpo-rlk \
    trainer.n_gpus_per_node=8 \
    trainer.nnodes=1 \
    trainer.save_freq=-1 \
    trainer.test_freq=5 \
    trainer.total_epochs=15 \
    "$@"
