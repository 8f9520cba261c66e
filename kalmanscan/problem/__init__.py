"""A filter call's inputs, validated once: :func:`.prepare.prepare` turns the user's arrays into a
:class:`.prepare.Problem` (broadcast, converted, checked, with the facts that pick a backend's
path) that every backend trusts; :mod:`.checks` holds the value checks that cost at most one
device synchronisation."""
