"""The decision and how it is scored: :class:`~protrain_fx.plan.plan.plan.Plan` (what protrain
decided for one graph), the chunk layout, the cost model and the plan search. Pure data and
arithmetic: no FX, no runtime objects, nothing allocated.
"""
