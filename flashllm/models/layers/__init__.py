"""Layers that call the bound op table: linear, norm, rotary, attention, MLP, embedding."""
