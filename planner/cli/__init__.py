"""The command line (`ckpt-plan`, `python -m planner`): `main` parses and runs the commands,
`models` loads the model to plan (built-in examples, factories, Hugging Face configs)."""

__all__: list[str] = []
