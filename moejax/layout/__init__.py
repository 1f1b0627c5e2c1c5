"""The layout as data: which expert each slot hosts and how an expert's tokens split over its
replicas (`tables.Layout`, an argument of the compiled step, never a constant in it), the
host-side placement it is made from, and what follows from one: device loads, buffer rows and
drops, where expert weights sit in a parameter tree, and how weights and optimizer state move
between layouts and expert modes. No policy decides a layout here (moejax.placement does)."""
