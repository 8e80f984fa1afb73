"""recommend_policy: time training steps (or matmuls) per policy, pick one.

Modules, each importing only those listed below it:

- `api`: `recommend_policy`, its argument checks.
- `matmul_probe`, `model_probe`: what is timed without and with a model.
- `report`: `PolicyRecommendation` and the texts of its `reason`.
- `timing`: rounds of alternating samples until the choice is clear.

Nothing here imports `keras_mp.models` or `keras_mp.callbacks`.
"""

from keras_mp.recommend.api import recommend_policy
from keras_mp.recommend.report import PolicyRecommendation

__all__ = ["PolicyRecommendation", "recommend_policy"]
