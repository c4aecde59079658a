"""Residency manager: config, pure decision engine, replay and tuning."""
