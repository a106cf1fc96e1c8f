"""Model sources: presets, Hugging Face configs and parameter files, each read into a `ModelSpec`."""
