"""Drop-ins for trainers people already run: TRL (``pacs.integrations.trl``) and verl
(``pacs.integrations.verl``). Each is imported on its own, so neither framework is needed by the other."""
