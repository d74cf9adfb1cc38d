"""Run the project's Metal kernel text as C++ on the host (see emulate.py)."""
