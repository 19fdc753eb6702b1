"""protrain's step hooks stay innermost among the optimizer's own.

torch runs an optimizer's step pre-hooks, then its step, then its post-hooks, each in the order
they were registered. protrain registers its pre-hook (which commits or takes back the steps its
chunks took inside backward, and hides their gradients from torch's step) and its post-hook (which
gives the gradients back) at the model's first compiled call. A hook the user registers later
must still see the step as eager does: a pre-hook that clips or rewrites gradients must run
before protrain commits them, and one that raises must stop the step before anything is applied;
a post-hook that raises must not keep protrain's from giving the gradients back. So at every
``opt.step()`` protrain's pre-hook is moved to the end of the pre-hooks and its post-hook to the
front of the post-hooks (torch keeps both in ordered dicts, keyed by the handles' ids).
"""

from __future__ import annotations

import torch


def keep_innermost(opt: torch.optim.Optimizer, ids: tuple[int, int] | None) -> None:
    """Before ``opt.step()`` runs its hooks: protrain's pre-hook last, its post-hook first."""
    if ids is None:
        return
    pre_id, post_id = ids
    pre, post = opt._optimizer_step_pre_hooks, opt._optimizer_step_post_hooks
    if pre_id in pre and next(reversed(pre)) != pre_id:
        pre.move_to_end(pre_id)
    if post_id in post and next(iter(post)) != post_id:
        post.move_to_end(post_id, last=False)
