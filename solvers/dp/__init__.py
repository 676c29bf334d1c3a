"""Dynamic programming over region boundaries (`solve`: exact on chains, CNNs and transformers):
its search (`search`), what it may choose at each boundary (`settings`), the per-region tables it
reads (`tables`) and the Pareto fronts it keeps (`pareto`)."""

__all__: list[str] = []
