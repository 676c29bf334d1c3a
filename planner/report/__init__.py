"""Report: a plan as text (`text`) and as a picture of memory over one step (`plot`)."""
