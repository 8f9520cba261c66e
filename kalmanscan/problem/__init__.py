"""A filter call's inputs, validated once: :func:`.prepare.prepare` turns the user's arrays into a
:class:`.problem.Problem` (broadcast, converted, checked, with the plan: the backend, the outputs
asked for and the facts that pick a backend's path) that every backend trusts; :mod:`.bounds` is
the one table of the parameters' bounds and of the overflow limits; :mod:`.convert` turns values
into arrays and tensors and broadcasts their shapes; :mod:`.checks` holds the value checks that
cost at most one device synchronisation."""
