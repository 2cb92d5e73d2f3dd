"""Admin registrations that concern the whole site."""
