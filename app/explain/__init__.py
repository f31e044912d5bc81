"""The explain routes' serving side (app/routers/explain.py is the thin router): reading a request's
ablations, running model/explain.py on the model's side (the engine's model-call line or the
encoder's runner, as /attention does), and turning its numbers into the answers of
app/explain_schemas.py."""
