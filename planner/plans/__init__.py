"""Plans: the plan as a plain record (`record`), its JSON document (`document`), and the check
that a model matches a saved plan before it is applied (`matching`)."""
