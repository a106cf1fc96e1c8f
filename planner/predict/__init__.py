"""Prediction: hardware models, measured cost profiles, the step-time simulator, α selection."""
