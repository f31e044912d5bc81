"""A request's ablations (ablation.py: checked against the model, resolved to model/hooks.py's
ZEdits, echoed back), shared by /attention and the explain routes (app/explain_serving.py)."""
