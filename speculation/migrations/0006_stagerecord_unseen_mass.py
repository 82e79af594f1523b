from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("speculation", "0005_stagerecord_created_index"),
    ]

    operations = [
        migrations.AddField(
            model_name="stagerecord",
            name="unseen_mass",
            field=models.FloatField(blank=True, null=True),
        ),
    ]
