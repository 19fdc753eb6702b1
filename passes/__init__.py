"""protrain-fx graph passes. Each pass is a function ``(gm, plan) -> gm`` that rewrites or annotates
one FX graph and says in its docstring what it inserts and why. ``protrain_fx.pipeline`` lists which
passes run on which stage and what each reads and writes; they are also usable on their own.

Installed as ``protrain_fx.passes`` (the source folder is the top-level ``passes/``).
"""

from protrain_fx.graph.annotation import META_KEY, NodeAnnotation, annotation_of
from protrain_fx.passes.annotate import annotate

__all__ = ["META_KEY", "NodeAnnotation", "annotate", "annotation_of"]
