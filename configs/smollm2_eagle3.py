"""An EAGLE-3 drafter on SmolLM2-135M-Instruct: `smollm2_eagle.py` with EAGLE-3's drafter.

  python -m launch.train --config=configs/smollm2_eagle3.py --workdir=workdirs/smollm2_eagle3

Three changes to `smollm2_eagle.py` (see mtp/model/heads/eagle.py):
  * fused features: depth 1 reads one projection of the inputs of trunk layers 2, 15 and 27
    (EAGLE-3's 2, L/2, L-3 of SmolLM2's 30), not the last normed state; the frozen trunk's cache
    keeps those inputs too;
  * EAGLE-3's input layer: q/k/v read the normed [embedding; feature], the feature is the
    residual, and the drafter has its own final norm;
  * no feature regression (EAGLE-3 trains on the tokens alone).
Its `launch.export --format=hf` writes vLLM's EAGLE-3 layout (`eagle3/`).
"""

from configs import smollm2_eagle


def get_config():
  c = smollm2_eagle.get_config()
  c.model.eagle_features = 'fused'
  c.model.eagle_input = 'concat'
  c.model.eagle_feature_loss_weight = 0.0
  return c
