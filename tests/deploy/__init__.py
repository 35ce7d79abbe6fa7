"""Deployment artefacts: Dockerfile, Helm chart and their docs."""
