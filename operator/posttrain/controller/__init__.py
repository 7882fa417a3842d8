"""The kopf operator: thin handlers over the pure functions in phase/ and render/."""
